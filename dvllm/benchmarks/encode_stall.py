"""How long the denoise loop stalls when a burst of new prompts arrives while a batch runs, encode stage on vs off.

One run, the two engines interleaved round by round (off, on, then on, off, ...). Each round: `--runners`
requests start alone and take `--warm-steps` steps; then a burst of `--burst` requests arrives at once, each with a
prompt and a negative prompt of its own (CFG on), none of them in the prompt cache (every round has new texts; the
two engines get the same ones), and takes `--steps` steps. The runners are long enough to outlive the burst (they
are aborted once it is done; the run stops if one finishes first), so every text of the burst is encoded while a
batch runs. Without the stage, the step that admits the burst runs the text encoder on all of its texts before its
forward; with it, the texts are encoded on the stage's thread while the runners keep stepping, and the burst joins
once they are ready.

The loop's gaps are timed between consecutive denoiser forwards (the end of one to the start of the next), from the
round's first forward until the burst's last image is out; on a GPU the loop's stream is waited for before and
after each forward, so that an encode queued on it (which the host does not wait for) counts in the gap. Both
engines run the decode stage, so the burst's decode is not in the loop (that stall is loop_stall's). Reported per
engine, medians over rounds: the longest gap, the mean gap, the gap before the forward of the step that admitted
the burst, the slowest forward (one with the whole burst: the scale), the round's wall time (the runners' start to
the burst's last image), the steps from the burst's arrival to its first step and over how many steps it was
admitted; over every burst request of every round, the latency from its arrival to its image (P50, P95). Then the
ratios on/off of the longest gap and of the wall time, and the largest difference between the two engines' images
of the same burst request (same texts, same seeds; they may differ by ~1e-6, as rows share forwards with different
neighbours).

What is compared: both engines at the engine's default `max_prompt_chars_per_step` (2 x max_prompt_chars, 20000
characters), which admits a whole burst of 16 of these requests (~520 characters each, prompt and negative) in
one step: the default setting is the one measured, and the stall without the stage is the whole burst's encode.
`--prompt-chars-per-step` sets it lower, for a burst that the engine without the stage spreads over several steps
(`admission_steps` says over how many it did). The stage may hold `max(32, 2 x burst)` texts, so that it encodes the
whole burst ahead in one go.

`--encode-workers N` adds a third engine, "workers": the stage with N encode worker processes (on
`--encode-device`), in the same rounds (off, on, workers, then workers, on, off, ...), with the same figures, its
ratios to the engine without the stage, and the largest difference between its images and the other two's.

    python -m dvllm.benchmarks.encode_stall --model sd15 --size 64 --burst 16

The presets' byte-level CLIP tokenizer reads a prompt's first 75 bytes (77 tokens, a real CLIP tokenizer about 60
words) and every text is padded to 77 tokens, so each text costs the encoder the same whatever its length; the
texts differ in their first words.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import diffusers
import numpy as np
import transformers

from dvllm import DiffusionEngine, SamplingParams
from dvllm.benchmarks.loop_stall import gaps, run_off_on, time_forwards

WORDS = (
    "red green blue yellow orange purple black white pink golden silver small large tiny huge old young "
    "bright dark quiet busy ancient modern wooden glass stone cloudy sunny rainy misty snowy winter summer "
    "autumn spring morning evening night river mountain forest desert ocean city village garden castle bridge "
    "tower harbor market street meadow lake island valley canyon cliff beach field road train boat ship "
    "airplane bicycle horse cat dog bird fox wolf bear owl deer rabbit dragon robot knight wizard painter "
    "sailor farmer child woman man portrait landscape watercolor oil sketch photograph detailed soft sharp "
    "cinematic dramatic lighting shadows reflections colorful muted vivid highly intricate elegant simple"
).split()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd15", help="A preset, folder or Hub id (dummy weights for presets).")
    parser.add_argument("--size", type=int, default=64, help="Side of every image, in pixels.")
    parser.add_argument("--burst", type=int, default=16, help="Requests that arrive together, each with new texts.")
    parser.add_argument("--runners", type=int, default=1, help="Requests already running when the burst arrives.")
    parser.add_argument("--steps", type=int, default=4, help="The burst's steps.")
    parser.add_argument("--warm-steps", type=int, default=2, help="Steps the runners take before the burst arrives.")
    parser.add_argument("--runner-steps", type=int, default=400,
                        help="The runners' steps: enough to outlive the burst (they are aborted once it is done).")
    parser.add_argument("--guidance", type=float, default=7.5, help="Guidance scale of every request (CFG).")
    parser.add_argument("--prompt-words", type=int, default=60, help="Words in each burst prompt.")
    parser.add_argument("--prompt-chars-per-step", type=int, default=None,
                        help="The engines' max_prompt_chars_per_step (default: the engine's, 2 x max_prompt_chars).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds per engine, interleaved.")
    parser.add_argument("--encode-workers", type=int, default=0,
                        help="Also run the stage with this many encode worker processes (0: not run).")
    parser.add_argument("--encode-device", default=None,
                        help="The encode workers' device(s), comma-separated (default: the CPU).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", help="Write the figures as JSON here.")
    return parser


def burst_texts(round_index: int, n: int, words: int) -> list[tuple[str, str]]:
    """(prompt, negative prompt) of each request of a round's burst: each text differs from every other text of
    every round in its first words, and the prompt has `words` words (the negative a third as many)."""
    texts = []
    for i in range(n):
        rng = random.Random(f"{round_index}:{i}")
        prompt = f"burst {round_index} request {i}: " + " ".join(rng.choices(WORDS, k=max(1, words - 4)))
        negative = f"not {round_index}-{i}, " + " ".join(rng.choices(WORDS, k=max(1, words // 3 - 2)))
        texts.append((prompt, negative))
    return texts


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Round:
    longest_gap: float
    mean_gap: float
    admission_gap: float       # the gap before the forward of the step that admitted the burst
    longest_forward: float     # the slowest forward: one with the whole burst, for scale
    wall: float
    latencies: list[float]     # each burst request's, arrival to final image
    steps_to_admit: int        # steps from the burst's arrival to its first, that one included (at best 1)
    admission_steps: int       # steps in which burst requests took their first step (the burst admitted at once: 1)
    images: list[np.ndarray] = field(repr=False)


@contextlib.contextmanager
def _quiet_truncation():
    """The prompts are cut at the tokenizer's limit, as a client's long prompts are: no warning for each."""
    libraries = (diffusers.utils.logging, transformers.utils.logging)
    levels = [library.get_verbosity() for library in libraries]
    for library in libraries:
        library.set_verbosity_error()
    try:
        yield
    finally:
        for library, level in zip(libraries, levels):
            library.set_verbosity(level)


def _engine(args: argparse.Namespace, stage: bool, workers: int = 0) -> DiffusionEngine:
    engine = DiffusionEngine(model=args.model, load_format="auto", device=args.device, encode_stage=stage,
                             encode_workers=workers, encode_device=args.encode_device if workers else None,
                             decode_stage=True,
                             max_batch_size=2 * (args.burst + args.runners), max_image_pixels=args.size ** 2,
                             max_encode_ahead=max(32, 2 * args.burst),
                             max_prompt_chars_per_step=args.prompt_chars_per_step)
    # on a GPU, the times of the loop's stream: an encode queued before a forward counts in the gap before it
    cuda = engine.loaded_model.device.startswith("cuda")
    engine.forwards = time_forwards(engine, sync=cuda)  # type: ignore[attr-defined]
    return engine


def _round(engine: DiffusionEngine, args: argparse.Namespace, index: int) -> Round:
    common = {"height": args.size, "width": args.size, "guidance_scale": args.guidance, "output_type": "np"}
    runners = [(f"runner-{index}-{i}", SamplingParams(seed=100 + i, num_inference_steps=args.runner_steps, **common))
               for i in range(args.runners)]
    # checked before the round (as the async engine does, off the loop), so that the loop's gaps are the engine's
    burst = [engine.processor.process(
        f"burst-{index}-{i}", prompt,
        SamplingParams(seed=1000 * index + i, num_inference_steps=args.steps, negative_prompt=negative, **common))
        for i, (prompt, negative) in enumerate(burst_texts(index, args.burst, args.prompt_words))]
    engine.forwards.clear()
    start = time.perf_counter()
    for request_id, params in runners:
        engine.add_request(request_id, "a runner that keeps the loop stepping", params)
    for _ in range(args.warm_steps):
        _check(engine.step())
    arrival = time.perf_counter()
    for request in burst:
        engine.add_processed(request)
    pending = {request.request_id for request in burst}
    finished: dict[str, tuple[float, np.ndarray]] = {}
    first_steps: set[int] = set()  # the steps in which burst requests took their first step
    first_forward = None           # the index of the forward of the first of them
    started: set[str] = set()
    step = 0
    while pending:
        before = len(engine.forwards)
        outputs = _check(engine.step())
        now, step = time.perf_counter(), step + 1
        for out in outputs:
            if out.request_id in pending:
                if out.request_id not in started:
                    started.add(out.request_id)
                    first_steps.add(step)
                    first_forward = before if first_forward is None else first_forward
                if out.finished:
                    pending.discard(out.request_id)
                    finished[out.request_id] = (now, out.images[0])
    wall = time.perf_counter() - start
    spans = list(engine.forwards)
    between = gaps(spans)
    for request_id, _ in runners:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    order = [request.request_id for request in burst]
    return Round(longest_gap=max(between), mean_gap=statistics.fmean(between), admission_gap=between[first_forward - 1],
                 longest_forward=max(end - begin for begin, end in spans), wall=wall,
                 latencies=[finished[r][0] - arrival for r in order],
                 steps_to_admit=min(first_steps), admission_steps=len(first_steps),
                 images=[finished[r][1] for r in order])


def _check(outputs: list) -> list:
    """The outputs of a step of the round, which neither fails a request nor finishes a runner."""
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"{out.request_id} failed: {out.error}")
        if out.request_id.startswith("runner-") and out.finished:
            raise RuntimeError(f"{out.request_id} finished before the burst: raise --runner-steps")
    return outputs


def _summary(rounds: list[Round]) -> dict[str, Any]:
    latencies = [x for r in rounds for x in r.latencies]
    per_round = [{"longest_gap_s": r.longest_gap, "mean_gap_s": r.mean_gap, "admission_gap_s": r.admission_gap,
                  "longest_forward_s": r.longest_forward, "wall_s": r.wall, "steps_to_admit": r.steps_to_admit,
                  "admission_steps": r.admission_steps}
                 for r in rounds]
    return {
        **{key: statistics.median(r[key] for r in per_round) for key in per_round[0]},
        "burst_latency_p50_s": percentile(latencies, 50),
        "burst_latency_p95_s": percentile(latencies, 95),
        "rounds": per_round,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    with _quiet_truncation():
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return run_off_on(args, _engine, _compare)


def _compare(engines: dict[str, DiffusionEngine], args: argparse.Namespace) -> dict[str, Any]:
    if not args.encode_workers:
        return _compare_all(engines, args)
    # the third engine, made here so that run_off_on's two stay as they are; shut down whatever happens
    workers = _engine(args, True, args.encode_workers)
    try:
        return _compare_all({**engines, "workers": workers}, args)
    finally:
        workers.shutdown()


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _compare_all(engines: dict[str, DiffusionEngine], args: argparse.Namespace) -> dict[str, Any]:
    # warm up: kernels, the runners' text in the prompt cache, the stage's thread (and its encode workers)
    for engine in engines.values():
        _round(engine, args, 0)
    rounds: dict[str, list[Round]] = {k: [] for k in engines}
    worst_diff = worst_workers_diff = 0.0
    for r in range(1, args.rounds + 1):
        images = {}
        for name in list(engines) if r % 2 else list(engines)[::-1]:
            result = _round(engines[name], args, r)
            rounds[name].append(result)
            images[name] = result.images
        worst_diff = max(worst_diff, _max_diff(images["on"], images["off"]))
        if "workers" in images:
            worst_workers_diff = max(worst_workers_diff, _max_diff(images["workers"], images["off"]),
                                     _max_diff(images["workers"], images["on"]))
    texts = burst_texts(1, args.burst, args.prompt_words)
    result: dict[str, Any] = {
        "model": args.model, "size": args.size, "burst": args.burst, "runners": args.runners, "steps": args.steps,
        "warm_steps": args.warm_steps, "rounds": args.rounds, "guidance": args.guidance, "device": args.device,
        "burst_chars": sum(len(p) + len(n) for p, n in texts),
        "prompt_chars_per_step": engines["off"].config.prompt_chars_per_step,
        **{name: _summary(rounds[name]) for name in engines},
        "burst_images_max_abs_diff": worst_diff,
    }
    result["gap_ratio_on_off"] = result["on"]["longest_gap_s"] / result["off"]["longest_gap_s"]
    result["wall_ratio_on_off"] = result["on"]["wall_s"] / result["off"]["wall_s"]
    if "workers" in engines:
        result.update(encode_workers=args.encode_workers, encode_device=args.encode_device,
                      workers_images_max_abs_diff=worst_workers_diff,  # against both other engines' images
                      gap_ratio_workers_off=result["workers"]["longest_gap_s"] / result["off"]["longest_gap_s"],
                      wall_ratio_workers_off=result["workers"]["wall_s"] / result["off"]["wall_s"])
    return result


if __name__ == "__main__":
    main()
