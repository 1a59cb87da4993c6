"""One engine iteration on the worker, as the numbered stages of a diffusers pipeline it runs (_stage_list):
encode prompts, prepare latents, denoise, decode, each a function of the step's diff (step_work.StepWork). All
request state lives in the pool.

A failure is pinned on the request that caused it: a stage's batched call that raises is retried request by
request, and only the requests that still fail are dropped (step_work.run_stages, for every stage alike).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from dvllm.core.scheduler_output import NewRequestData, ResumedRequestData, RunnerOutput, SchedulerOutput
from dvllm.core.stage_stats import StageStats
from dvllm.lora.cache import LoraCache
from dvllm.models.base import ModelAdapter
from dvllm.profiler import PhaseTimer
from dvllm.step_caches.state import CacheState
from dvllm.worker.decode_stage import DecodeJob, DecodeStage
from dvllm.worker.denoise_batch import StepParts, denoise_step
from dvllm.worker.denoiser import Denoiser
from dvllm.worker.encode_stage import EncodeStage, image_prompt_key, start_key
from dvllm.worker.control_state import write_control_images
from dvllm.worker.controlnets import ControlPlanner, control_planner
from dvllm.worker.shared_entries import fail_readers, written_entries
from dvllm.worker.forward_context import ForwardHooks
from dvllm.worker.ip_adapter_load import install_row_processors
from dvllm.worker.lora_layers import LoraLayers
from dvllm.worker.output_types import to_output_type
from dvllm.worker.prompt_writer import PromptWriter
from dvllm.worker.request_state import RequestState, row_bounds
from dvllm.worker.start_latents import Start, make_start
from dvllm.worker.state_pool import StatePool
from dvllm.worker.step_cache_hooks import CacheHooks
from dvllm.worker.step_work import Stage, StepWork, run_stages
from dvllm.worker.swap import swap_in, swap_out
from dvllm.worker.vae_calls import decode_by_request, decode_call

logger = logging.getLogger(__name__)
# How long a step with nothing to run but decodes (or encodes) to await waits for one (the loop comes back for new
# requests)
_AWAIT_STAGE_S = 0.02


class ModelRunner:
    def __init__(self, adapter: ModelAdapter, pool: StatePool, denoiser: Denoiser, timer: PhaseTimer,
                 max_decode_batch: int = 4, max_loras: int = 4, max_lora_rank: int = 64,
                 decode_stage: DecodeStage | None = None, lora_cache: LoraCache | None = None,
                 controlnets: dict[str, Any] | None = None, ip_adapter: Any = None) -> None:
        self.adapter = adapter
        self.max_decode_batch = max_decode_batch
        self.decode_stage = decode_stage  # None: the loop decodes
        self.pool = pool
        self.denoiser = denoiser
        self.timer = timer
        self.states: dict[str, RequestState] = {}
        self._cache_hooks: CacheHooks | None = None  # installed on the transformer with the first caching request
        self.hooks = ForwardHooks()  # every hook on the pipeline's modules that takes a forward's context
        self.lora = LoraLayers(adapter.pipeline, max_loras, max_lora_rank, self.hooks)
        self.controlnets = controlnets or {}  # by name: requests' controls run them (worker/controlnets.py)
        # each step's controls, grouped (None: the engine serves no controlnets)
        self.controls: ControlPlanner | None = control_planner(adapter, self.controlnets, self.hooks) \
            if self.controlnets else None
        self.ip_adapter = ip_adapter  # requests' image prompts read it (worker/image_prompts.py)
        if ip_adapter is not None:
            install_row_processors(ip_adapter, adapter, self.hooks)
        self.lora_cache = lora_cache  # the adapters' weights, read from the ids the loads name (None: no LoRA)
        self.prompts = PromptWriter(adapter, pool, self.lora)
        # The last step's prompt-cache blocks left unwritten and adapter loads that failed: with async scheduling
        # the driver admitted this step's requests before it heard of them, so they are checked against both
        self._last_unwritten: dict[tuple[int, ...], str] = {}
        self._last_failed_loras: dict[str, tuple[int, str]] = {}
        self._reported: dict[str, int] = {}  # running counts (restarts, group forwards) as last reported
        self.group = None  # the worker's group (parallel/group.py), whose reforms are reported as restarts
        self._stages = self._stage_list()

    @property
    def encode_stage(self) -> EncodeStage | None:
        return self.prompts.encode_stage

    @property
    def cache_hooks(self) -> CacheHooks:
        if self._cache_hooks is None:
            self._cache_hooks = CacheHooks(self.adapter.cache_spec(), self.hooks)
        return self._cache_hooks

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        work = StepWork(out)
        run_stages(self, self._stages, work, self.timer)
        return work.output(self.stage_processes())

    def _stage_list(self) -> tuple[Stage, ...]:
        """The iteration's stages, in the order a diffusers pipeline runs them, each a function of the step's diff
        (StepWork). A stage with `items` runs on those requests, retried one by one when the group fails."""
        return (
            # 0. the encode stage's jobs first: what admission below takes may have been sent long ago
            Stage("encode submission", "_submit_encodes"),
            Stage("LoRA reads", "_read_loras_ahead"),  # (adapters of waiting requests, on the reader thread)
            # 1. what the scheduler freed; adapters into the slots it chose
            Stage("freeing", "_free"),
            Stage("LoRA loading", "_load_loras"),
            # 2. preempted state leaves the pool before anyone writes into the blocks it frees
            Stage("swap-out", "_swap_out", items=self._preempted, alone=True),
            # 3. encode prompts (one text-encoder call for all cache misses), prepare latents, swap in
            Stage("prompt encoding", "_encode_prompts", phase="encode", timed="encode"),
            Stage("latent preparation", "_prepare_latents", items=lambda work: work.ready, phase="encode",
                  timed="encode"),
            Stage("swap-in", "_swap_in", items=lambda work: work.out.resumed_requests, alone=True,
                  phase="encode", timed="encode"),
            Stage("admission", "_admitted", phase="encode", timed="encode"),
            # 4. denoise: one forward over the batch, each row's sampler update fused into the pool write
            Stage("batching", "_batch"),
            Stage("denoise", "_denoise", items=lambda work: work.batch, checkpoint=_rng_checkpoint,
                  timed="denoise"),
            # 5. decode the requests that took their last step (the decode stage takes what it has room for)
            Stage("hand-over", "_hand_over", phase="decode", timed="decode"),
            Stage("decode", "_decode", items=lambda work: [s for s in work.finished if s.request_id not in
                                                                work.decoding], phase="decode", timed="decode"),
            Stage("preview decoding", "_decode_previews", phase="decode", timed="decode"),
            Stage("finishing", "_finish"),
            # 6. what the stages finished meanwhile
            Stage("collection", "_collect"),
        )

    def _submit_encodes(self, work: StepWork) -> None:
        if self.encode_stage is not None:
            self.encode_stage.drop(work.out.encode_drops)
            self.encode_stage.submit(work.out.encode_jobs, work.out.encode_images, work.out.encode_starts,
                                     work.out.encode_image_prompts)

    def _free(self, work: StepWork) -> None:
        for request_id in work.out.freed_ids:
            self.states.pop(request_id, None)
        if self.decode_stage is not None and work.out.freed_ids:
            self.decode_stage.drop(set(work.out.freed_ids))

    def _read_loras_ahead(self, work: StepWork) -> None:
        for ref in work.out.lora_reads if self.lora_cache is not None else ():  # (none: their loads fail, naming why)
            self.lora_cache.read_ahead(ref)

    def _load_loras(self, work: StepWork) -> None:
        """Copies adapters into their slots. A load that fails fails the new and resumed requests that use it,
        and, with async scheduling, those the driver admitted before it heard of the failure (the last step's)."""
        loaded = {ref.digest for _, ref in work.out.lora_loads}
        carried = {digest: v for digest, v in self._last_failed_loras.items() if digest not in loaded}
        for slot, ref in work.out.lora_loads:  # each read ahead into the host cache (else read now)
            try:
                if self.lora_cache is None:
                    raise RuntimeError("this worker serves no LoRA adapters (enable_lora is off)")
                self.lora.load(slot, self.lora_cache.weights(ref))
                if self.group is not None:  # the group's members hold the same slots
                    self.group.load_lora(slot, ref)
            except Exception as e:
                logger.exception("LoRA adapter %r could not be loaded into slot %d", ref.name, slot)
                self.lora.evict(slot)
                if self.group is not None:
                    self.group.lora_slots.pop(slot, None)
                work.failed_loras[ref.digest] = (slot, f"LoRA adapter {ref.name!r} could not be loaded on the "
                                                       f"worker: {type(e).__name__}: {e}")
        self._last_failed_loras = work.failed_loras
        work.unwritten = _fail_lora_users(work.out, self.states, {**carried, **work.failed_loras}, work.errors)

    def _preempted(self, work: StepWork) -> list[RequestState]:
        return [self.states[request_id] for request_id in work.out.preempted_ids if request_id in self.states]

    def _batch(self, work: StepWork) -> None:
        """The requests this step denoises, each at the step the scheduler counted for it."""
        for request_id, step in zip(work.out.scheduled_ids, work.out.step_indices):
            if request_id in self.states and request_id not in work.errors:
                self.states[request_id].step = step
                work.batch.append(self.states[request_id])
        if work.batch:
            work.stats.add("denoise", 0.0, work.out.num_rows)
            if self.group is not None:
                self.group.choose_split(work.out.num_rows)

    def _denoise(self, work: StepWork, group: list[RequestState]) -> None:
        parts = StepParts(self.adapter, self.denoiser, self.pool, self.timer, self.lora, self.hooks,
                          self.cache_hooks if any(s.cache is not None for s in group) else None, self.controls,
                          self.ip_adapter)
        result = denoise_step(parts, group)
        work.errors.update(result.errors)
        work.x0.update(result.previews)
        work.cached.update(result.cached)

    def _finish(self, work: StepWork) -> None:
        """The step's decode counted; the states of requests that are done (or failed) forgotten."""
        images, previews = work.images, work.previews
        work.stats.add("decode", 0.0, sum(map(len, images.values())) + sum(map(len, previews.values())))
        work.preview_steps = {request_id: self.states[request_id].step + 1 for request_id in previews}
        for request_id in [*images, *work.errors, *work.decoding]:
            self.states.pop(request_id, None)

    def _collect(self, work: StepWork) -> None:
        """What the stages finished meanwhile (waiting a little when requests wait for it and there is nothing
        else to do)."""
        out = work.out
        if self.decode_stage is not None:
            with self.timer.phase("decode"):
                done = self.decode_stage.collect(timeout=_AWAIT_STAGE_S if out.await_decodes else 0.0)
            work.images.update(done.images)
            work.errors.update(done.errors)
            work.previews.update(done.previews)
            work.preview_steps.update(done.preview_steps)
            work.stats.add("decode_stage", done.seconds, done.num_images)
        if self.encode_stage is not None:
            work.encoded = self.encode_stage.collect(timeout=_AWAIT_STAGE_S if out.await_encodes else 0.0)
            work.stats.add("encode_stage", work.encoded.seconds, work.encoded.num_texts)
        if self.lora_cache is not None:
            work.loras_read, work.loras_dropped = self.lora_cache.report(
                timeout=_AWAIT_STAGE_S if out.await_lora_reads else 0.0)
        self._report_restarts(work.stats)

    def _report_restarts(self, stages: StageStats) -> None:
        """The stages' threads and processes, and the group's members, restarted since the last step's report (and
        of the processes, those that passed a call's bound); the group's forwards, by split, since then."""
        counts = {} if self.group is None else {"worker_group.members": self.group.restarts}
        timeouts = {} if self.group is None else {"worker_group.members": sum(m.timeouts for m in self.group.members)}
        for name, stage in (("encode_stage", self.encode_stage), ("decode_stage", self.decode_stage)):
            if stage is not None:
                counts |= {f"{name}.thread": stage.restarts,
                           f"{name}.process": sum(w.restarts for w in stage.workers)}
                timeouts[f"{name}.process"] = sum(w.timeouts for w in stage.workers)
        self._report_new(counts, stages.restarts, "")
        self._report_new(timeouts, stages.timeouts, "timeouts.")
        if self.group is not None:
            self._report_new(self.group.forwards, stages.group_forwards, "forwards.")

    def stage_processes(self) -> list[dict]:
        """Each stage process's heartbeat (StageProcess.health), named by its stage and index."""
        stages = (("encode_stage", self.encode_stage), ("decode_stage", self.decode_stage))
        parts = [(name, stage.workers) for name, stage in stages if stage is not None]
        if self.group is not None:
            parts.append(("worker_group", self.group.members))
        return [{"stage": name, "index": p.index, **p.health()} for name, processes in parts for p in processes]

    def _report_new(self, counts: dict[str, int], into: dict[str, int], prefix: str) -> None:
        """What each of the running `counts` grew by since it was last reported, into `into`."""
        for part, count in counts.items():
            last = self._reported.get(prefix + part, 0)
            if count > last:
                into[part] = count - last
                self._reported[prefix + part] = count

    # 3. encode prompts (one text-encoder call for all cache misses), prepare latents
    def _encode_prompts(self, work: StepWork) -> None:
        """Writes the new requests' prompt embeddings; a request fails with the embedding it reads, whoever was
        to write it."""
        write_control_images(self.pool, work.out.new_requests)
        work.admitting = work.live(work.out.new_requests, lambda d: d.request_id)
        work.stats.add("encode", 0.0, len(work.out.new_requests))
        if not work.admitting:
            return
        failed = self.prompts.write(work.admitting)
        for d in work.admitting:
            needed = {tuple(d.blocks.cond)} | ({tuple(d.blocks.uncond)} if d.cfg else set())
            bad = needed & failed.keys()
            if bad:
                work.errors[d.request_id] = failed[next(iter(bad))]
            else:
                work.ready.append(d)
        work.unwritten.update(failed)

    def _prepare_latents(self, work: StepWork, group: list[NewRequestData]) -> None:
        """Seeds each new request's latents as its pipeline does (new requests may differ in size: one write
        each), and makes its state."""
        for d in group:
            start = self._started_ahead(d) or make_start(self.adapter, d.start_job(), self.controlnets)
            x, generator = start.latents, start.generator
            if start.inputs is not None:
                self.pool.write(d.blocks.inputs, start.inputs.reshape(d.n, -1))
            self.pool.write(d.blocks.latents, x.reshape(d.n, -1))
            if d.blocks.history:  # multistep history starts at zero (its first steps read it with weight 0)
                self.pool.write(d.blocks.history, self.pool.data.new_zeros(len(d.blocks.history), x[0].numel()))
            self.states[d.request_id] = RequestState(
                data=d, generator=generator, blocks=d.blocks,
                fallback=None if d.plan.vectorized else d.plan.new_fallback_scheduler(),
                cache=None if d.cache is None else CacheState.sized(d.cache, self.adapter.info.cache_layout, d),
                control_images=start.controls,
            )

    def _admitted(self, work: StepWork) -> None:
        """After admission: the prepared requests' text lengths read and their image prompts' embeds taken from
        the encode stage (else encoded now); the starts and image prompts made ahead for requests that failed
        before theirs was taken dropped; and requests that read a prompt-cache
        entry another one was to fill and did not (this step's or, with async scheduling, the last step's) failed
        too."""
        out, errors = work.out, work.errors
        prepared = [self.states[d.request_id] for d in work.ready if d.request_id in self.states]
        if prepared:
            self.prompts.read_text_lengths(prepared)
        if self.ip_adapter is not None:
            errors.update(self.ip_adapter.encode_admitted(prepared, self._image_prompt_ahead))
        if self.encode_stage is not None and work.admitting:
            self.encode_stage.drop([key(d.request_id) for d in work.admitting for key in (start_key, image_prompt_key)])
        for resumed in out.resumed_requests:  # a failed swap-in was to refill shared entries: they hold nothing
            if resumed.request_id in errors:
                work.unwritten.update(dict.fromkeys(written_entries(resumed.blocks), errors[resumed.request_id]))
        admitted = [*out.new_requests, *out.resumed_requests]
        written = {b for d in admitted for b in written_entries(d.blocks)}
        stale = {b: why for b, why in self._last_unwritten.items() if b not in written}
        fail_readers(admitted, {**stale, **work.unwritten}, errors)
        self._last_unwritten = work.unwritten

    def _image_prompt_ahead(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image prompt's embeds the encode stage made for the request, if it holds them."""
        return None if self.encode_stage is None else self.encode_stage.take(image_prompt_key(request_id))

    def _started_ahead(self, d: NewRequestData) -> Start | None:
        """The start the encode stage made for the request (one with input images), if it holds one."""
        if self.encode_stage is None or d.image is None:
            return None
        return self.encode_stage.take(start_key(d.request_id))

    # preemption: the request's pool contents go to host memory and come back unchanged (swap.py)
    def _swap_out(self, work: StepWork, group: list[RequestState]) -> None:
        swap_out(group[0], self.pool, self.adapter.info)

    def _swap_in(self, work: StepWork, group: list[ResumedRequestData]) -> None:
        swap_in(self.states[group[0].request_id], group[0].blocks, self.pool)

    # 5. decode
    def _hand_over(self, work: StepWork) -> None:
        """The requests that took their last step, and the x0 estimates of those due for a preview; the decode
        stage gets what it has room for (the finished ones `work.decoding`)."""
        finishing = set(work.out.finishing_ids)
        work.finished = [s for s in work.batch if s.request_id in finishing and s.request_id not in work.errors]
        work.x0 = {k: v for k, v in work.x0.items() if k not in work.errors}
        work.decoding = self._give_stage(work.finished, work.x0)

    def _give_stage(self, finished: list[RequestState], x0: dict[str, torch.Tensor]) -> set[str]:
        """Gives the decode stage what it has room for: the previews' x0 estimates (taken out of `x0`) and the
        finished requests' latents (read out of the pool in one gather, so their blocks can be reused at once).
        Returns the finished requests it took; the others (and latent outputs, which need no decode) the loop
        decodes as before."""
        stage = self.decode_stage
        if stage is None:
            return set()
        jobs: list[DecodeJob] = []
        # previews first: the stage works in order, so a request's preview is never back after its final images
        for request_id, latents in list(x0.items()):
            data = self.states[request_id].data
            if stage.has_room(sum(j.n for j in jobs) + len(latents)):
                jobs.append(DecodeJob(request_id, latents.to(self.adapter.dtype), data.size,
                                      "pil" if data.output_type == "latent" else data.output_type, preview=True,
                                      step=self.states[request_id].step + 1, tiled=data.decode_tiled))
                del x0[request_id]
        images = sum(j.n for j in jobs)
        takers = []
        for s in finished:
            if s.data.output_type != "latent" and stage.has_room(images + s.n):
                takers.append(s)
                images += s.n
        if takers:  # one forward's finishers: one size
            size = takers[0].data.size
            shape = self.adapter.info.latents.shape(*size)
            latents = self.pool.read([r for s in takers for r in s.blocks.latents], math.prod(shape))
            latents = latents.view(-1, *shape)
            for s, (lo, hi) in zip(takers, row_bounds(takers)):
                jobs.append(DecodeJob(s.request_id, latents[lo:hi], size, s.data.output_type,
                                      tiled=s.data.decode_tiled))
        stage.submit(jobs)
        return {s.request_id for s in takers}

    def decode_requests(self, latents: torch.Tensor, counts: list[int], size: tuple[int, ...],
                        tiled: list[bool] | None = None) -> torch.Tensor:
        """Each request's images in VAE calls of their own (vae_calls.py says why), at most max_decode_batch
        images a call: the decode's memory is bounded (and profiled); `tiled`: the requests decoded in tiles."""
        vae = self.adapter.pipeline.vae

        def decode(part: torch.Tensor, tiles: bool) -> torch.Tensor:
            return decode_call(vae, tiles, lambda: self.adapter.decode(part, size))

        with self.adapter.vae_lock:  # (the loop's, or the decode stage's thread)
            return decode_by_request(decode, latents, counts, self.max_decode_batch, tiled)

    def _decode_previews(self, work: StepWork) -> None:
        """Partial images: x0 estimates through the VAE (those the decode stage had no room for), each request's
        apart. A failed preview is skipped, not fatal."""
        work.previews = self._preview_images(work.x0)

    def _preview_images(self, x0: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
        if not x0:
            return {}
        try:
            first = self.states[next(iter(x0))].data  # one forward, one size
            latents = torch.cat(list(x0.values())).to(self.adapter.dtype)
            decoded = self.decode_requests(latents, [len(x) for x in x0.values()], first.size,
                                           [self.states[r].data.decode_tiled for r in x0])
        except Exception:
            logger.exception("preview decode failed for %s; skipping these previews", sorted(x0))
            return {}
        previews, lo = {}, 0
        for request_id, latents in x0.items():
            kind = self.states[request_id].data.output_type
            previews[request_id] = to_output_type(decoded[lo:lo + len(latents)], "pil" if kind == "latent" else kind)
            lo += len(latents)
        return previews

    def _decode(self, work: StepWork, group: list[RequestState]) -> None:
        """The finished requests' images, each request's in VAE calls of its own, in its output type."""
        shape = self.adapter.info.latents.shape(*group[0].data.size)  # one forward's finishers: one size
        latents = self.pool.read([r for s in group for r in s.blocks.latents], math.prod(shape))
        latents = latents.view(-1, *shape)
        bounds = row_bounds(group)
        pixels = [latents[lo:hi] for s, (lo, hi) in zip(group, bounds) if s.data.output_type != "latent"]
        size = group[0].data.size
        tiled = [s.data.decode_tiled for s in group if s.data.output_type != "latent"]
        decoded = self.decode_requests(torch.cat(pixels), [len(p) for p in pixels], size, tiled) if pixels else None
        lo_img = 0
        for s, (lo, hi) in zip(group, bounds):
            if s.data.output_type == "latent":
                work.images[s.request_id] = [x.cpu() for x in latents[lo:hi]]
            else:
                work.images[s.request_id] = to_output_type(decoded[lo_img:lo_img + s.n], s.data.output_type)
                lo_img += s.n


def _fail_lora_users(out: SchedulerOutput, states: dict[str, RequestState], failed: dict[str, tuple[int, str]],
                     errors: dict[str, str]) -> dict[tuple[int, ...], str]:
    """New and resumed requests whose adapter could not be loaded fail (running ones with it cannot exist:
    it was loaded for them). Returns the prompt-cache blocks they were to fill, now unwritten."""
    unwritten: dict[tuple[int, ...], str] = {}
    if not failed:
        return unwritten
    for data in [*out.new_requests, *out.resumed_requests]:
        loras = data.loras if isinstance(data, NewRequestData) else states[data.request_id].data.loras
        bad = next((digest for digest, _ in loras if digest in failed), None)
        if bad is not None:
            errors[data.request_id] = failed[bad][1]
            unwritten.update(dict.fromkeys(written_entries(data.blocks), errors[data.request_id]))
    return unwritten


def _rng_checkpoint(states: list[RequestState]) -> Callable[[], None]:
    """Each request's generator as it is now. A batched step may draw noise from
    every generator before it fails; a retry from the advanced generators would draw other noise than
    diffusers does, so the retry starts from these states. (Pool writes happen last, in the fused
    update, and fallback samplers' own failures are caught per request: neither needs restoring.)"""
    saved = [(s, s.generator.get_state()) for s in states]

    def restore() -> None:
        for s, rng in saved:
            s.generator.set_state(rng)

    return restore
