"""The flat EngineConfig resolved into the configs its packages own: each picks its fields, derives what the
engine config's properties used to, and checks them; check_at_start resolves them all before anything loads."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dvllm.config import EngineConfig
from dvllm.core.scheduler_config import SchedulerConfig
from dvllm.engine.configs import EngineConfigs
from dvllm.engine.start_checks import check_at_start
from dvllm.parallel.parallel_config import ParallelConfig
from dvllm.worker.pool_config import PoolConfig
from dvllm.worker.stage_config import StageConfig


def test_the_scheduler_config_derives_its_budgets_and_order():
    config = SchedulerConfig.of(EngineConfig(max_prompt_chars=100))
    assert config.prompt_chars_per_step == 200 and config.shape_order == "oldest" and not config.elastic
    assert SchedulerConfig.of(EngineConfig(max_prompt_chars_per_step=7)).prompt_chars_per_step == 7
    elastic = SchedulerConfig.of(EngineConfig(group_policy="elastic", sequence_parallel_size=2))
    assert elastic.shape_order == "turns" and elastic.elastic  # auto: in turn under the elastic policy
    assert SchedulerConfig.of(EngineConfig()).encode_ahead is None
    ahead = SchedulerConfig.of(EngineConfig(encode_workers=1, max_encode_ahead=5))
    assert ahead.encode_ahead == 5 and ahead.encode_always


def test_the_parallel_config_sizes_the_group_and_its_decodes():
    config = ParallelConfig.of(EngineConfig(sequence_parallel_size=2, cfg_parallel_size=2,
                                            group_devices="cpu,cpu,cpu"))
    assert config.size == 4 and config.devices == ("cpu", "cpu", "cpu") and config.group_decode
    assert not ParallelConfig.of(EngineConfig()).group_decode  # no group: nothing to share
    assert not ParallelConfig.of(EngineConfig(cfg_parallel_size=2, decode_workers=1)).group_decode


def test_the_stage_and_pool_configs_pick_their_fields():
    stages = StageConfig.of(EngineConfig(encode_workers=2, encode_device="cpu, cuda:1", max_batch_size=3,
                                         stage_call_timeout_s=7))
    assert stages.encode_stage and stages.encode_devices == ("cpu", "cuda:1") and stages.encode_batch == 6
    assert stages.call_timeout_s == 7 and stages.decode_devices == ()
    assert PoolConfig.of(EngineConfig(num_state_blocks=9)).num_state_blocks == 9
    with pytest.raises(ValueError, match="state_pool_mb"):
        PoolConfig.of(EngineConfig(state_pool_mb=0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
    (dict(gpu_memory_utilization=2), "gpu_memory_utilization"),
    (dict(decode_workers=65), "decode_workers must be an integer"),
    (dict(ring_degree=3), "ring_degree"),
])
def test_a_moved_field_is_refused_at_start(kwargs, message):
    config = EngineConfig(**kwargs)  # the flat arguments alone: their owner checks them
    with pytest.raises(ValueError, match=message):
        check_at_start(config)


def test_check_at_start_hands_back_the_resolved_configs():
    configs = check_at_start(EngineConfig(max_batch_size=3))
    assert isinstance(configs, EngineConfigs) and configs.scheduler.max_batch_size == 3


def test_core_reads_no_engine_config():
    """dvllm/core/ takes its SchedulerConfig: none of its modules imports dvllm.config."""
    for path in Path(__file__).parents[1].joinpath("dvllm", "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "dvllm.config", path.name
            elif isinstance(node, ast.Import):
                assert all(alias.name != "dvllm.config" for alias in node.names), path.name
