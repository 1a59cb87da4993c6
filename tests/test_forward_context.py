"""A forward's context reaches the hooks of the part it runs, for its span only (worker/forward_context.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from dvllm.worker.forward_context import DENOISER, TEXT_ENCODERS, ForwardContext, ForwardHooks, part_of


class _Hook:
    context = None


def test_a_context_is_given_to_its_parts_hooks_for_the_span_only():
    hooks, denoiser, encoder = ForwardHooks(), [_Hook(), _Hook()], _Hook()
    for hook in denoiser:
        hooks.add(DENOISER, hook)
    hooks.add(TEXT_ENCODERS, encoder)
    context = ForwardContext(lora="plan")
    with hooks.running(context):
        assert all(hook.context is context for hook in denoiser) and encoder.context is None
        assert hooks.context_of(DENOISER) is context and hooks.context_of(TEXT_ENCODERS) is None
    assert all(hook.context is None for hook in denoiser)
    with pytest.raises(ValueError, match="boom"), hooks.running(context):
        raise ValueError("boom")
    assert all(hook.context is None for hook in denoiser)  # taken back after a failed forward too
    with hooks.running(None):  # a forward with nothing for the hooks: they keep passing calls through
        assert hooks.context_of(DENOISER) is None


def test_a_part_runs_one_forward_at_a_time_while_the_other_runs_beside_it():
    hooks, denoiser, encoder = ForwardHooks(), _Hook(), _Hook()
    hooks.add(DENOISER, denoiser)
    hooks.add(TEXT_ENCODERS, encoder)
    loop, stage = ForwardContext(lora="loop's"), ForwardContext(lora="stage's")
    inside, done = threading.Event(), threading.Event()
    seen = []

    def encode() -> None:  # the encode stage's thread, while the loop's forward runs
        with hooks.running(stage, TEXT_ENCODERS):
            inside.set()
            seen.append((encoder.context, denoiser.context))
            done.wait(60)

    with hooks.running(loop):
        thread = threading.Thread(target=encode)
        thread.start()
        assert inside.wait(60)
        with pytest.raises(RuntimeError, match="one forward at a time"), hooks.running(ForwardContext(lora="x")):
            pass
        assert denoiser.context is loop  # the refused forward took nothing away
        done.set()
        thread.join()
    assert seen == [(stage, loop)]
    assert denoiser.context is None and encoder.context is None


def test_narrowing_nests_as_rows_of_the_whole_forward():
    context = ForwardContext()
    with context.narrow([1, 3], torch.tensor([1, 3])):
        assert context.rows.rows == [1, 3]
        with context.narrow([1], torch.tensor([1])):
            assert context.rows.rows == [3] and context.rows.index.tolist() == [3]
    assert context.rows.rows is None


def test_components_belong_to_parts_by_name():
    assert part_of("text_encoder_2") == TEXT_ENCODERS
    assert part_of("transformer_2") == part_of("unet") == DENOISER
