"""dvllm's runtime: what every process of dvllm's own besides the server's stands on (the engine core process, the
encode and decode workers, a worker group's members, the Ray actors of data parallelism).

- spawn.py: a process forked by the fork server or a fresh interpreter, dying with its parent, with its torch
  thread count; backends.py: that, or a thread of this process for tests whose subject is not the boundary.
- channel.py: one framed duplex channel; pickle for control, host tensors as raw frames of their own.
- calls.py, remote.py: calls with ids and answers, a remote's errors carried back (errors.py), a lost remote
  started again for the caller to redo its call.
- pending.py: a call sent without waiting (`submit`) is a Pending, several may be in flight on one remote, and
  `wait` waits across remotes' pending answers, with a timeout, for the ones done.
- ray_backend.py: a remote whose process is a Ray actor in a placement-group bundle (Ray imported there only):
  the same calls, pendings, bounds and errors, Ray's failures as the remote's loss; restart is its owner's call.
- liveness.py: each call's bound and the watchdog that enforces it, the heartbeat of a streaming process, and
  the pings of idle call-answering remotes (IdlePings).
"""
