"""SageMaker model-parallel keys: mapped onto paratrain's settings (TOML [smp], --smp JSON), every key it
cannot honour refused by name; explicit flags win."""

from __future__ import annotations

import json

import pytest

from paratrain.cli.flags import build_parser, run_config_from_args
from paratrain.cli.launching import prepare_launch
from paratrain.config import ConfigError, build_run_config, check_run
from paratrain.config.sagemaker import smp_overrides

ESTIMATOR = {  # an SMP v1 estimator's modelparallel parameters
    "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved",
    "optimize": "memory", "ddp": True, "shard_optimizer_state": True, "bf16": True,
    "activation_checkpointing": True, "offload_activations": True, "placement_strategy": "PDT",
    "auto_partition": True,
}


def test_the_estimator_keys_map_onto_paratrain_settings():
    assert smp_overrides(ESTIMATOR) == {
        "parallel.pp": 2, "parallel.tp": 2, "parallel.microbatches": 4, "parallel.schedule": "1f1b",
        "parallel.sequence_parallel": True, "parallel.zero": 1, "train.precision": "bf16",
        "train.recompute": "full", "parallel.offload": "activations"}
    # the whole `distribution` dict works too, and SMP v2's keys
    distribution = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "hybrid_shard_degree": 4, "tensor_parallel_degree": 2, "sm_activation_offloading": True, "random_seed": 3,
        "context_parallel_degree": 2, "expert_parallel_degree": 4}}}}
    assert smp_overrides(distribution) == {"parallel.zero": 3, "parallel.shard_group": 4, "parallel.tp": 2,
                                           "parallel.offload": "activations", "seed": 3, "parallel.cp": 2,
                                           "parallel.ep": 4}
    assert smp_overrides({"partitions": 4, "pipeline": "simple", "ddp": False}) == {
        "parallel.pp": 4, "parallel.schedule": "gpipe", "parallel.dp": 1}


@pytest.mark.parametrize("params,needle", [
    ({"placement_strategy": "cluster"}, "'placement_strategy' .* only 'PDT'"),
    ({"memory_weight": 0.5}, "'memory_weight' .* not supported: paratrain balances"),
    ({"horovod": True}, "'horovod' .* not supported: paratrain's data parallelism"),
    ({"auto_partition": False}, "'auto_partition' false is not supported"),
    ({"partitons": 2}, "unknown SageMaker model-parallel key 'partitons': paratrain maps"),
    ({"tensor_parallel_degree": "2"}, "must be an integer >= 1, got '2'"),
    ({"pipeline": "1f1b"}, "'pipeline' must be one of 'simple', 'interleaved'"),
    ({"fp16": True, "bf16": True}, "both fp16 and bf16"),
    ({"smdistributed": {"modelparallel": {"enabled": False, "parameters": {"microbatches": 2}}}}, "enabled: false"),
])
def test_keys_paratrain_cannot_honour_are_refused_by_name(params, needle):
    with pytest.raises(ConfigError, match=needle):
        smp_overrides(params)


def test_a_toml_smp_table_is_a_layout():
    """8 processes: SMP's pp 2 x tp 2 leaves dp 2; its 4 micro-batches set the micro-batch (16 / (2 x 4))."""
    table = {"smp": ESTIMATOR, "data": {"global_batch": 16}}
    plan = check_run(build_run_config(table), 8)
    assert (plan.parallel.dp, plan.parallel.tp, plan.parallel.pp, plan.parallel.zero) == (2, 2, 2, 1)
    assert plan.batch.micro_batch == 2 and plan.batch.accumulation == 4
    assert plan.parallel.sequence_parallel and plan.config.train.recompute == "full"
    with pytest.raises(ConfigError, match=r"\[smp\] must be a table"):
        build_run_config({"smp": 3})


def test_smp_json_on_the_command_line_and_flags_win(tmp_path):
    flags = ["train", "--device", "cpu", "--nproc", "4", "--global-batch", "8", "--no-memory-check"]
    plan = prepare_launch(run_config_from_args(build_parser().parse_args(
        [*flags, "--smp", json.dumps({"sharded_data_parallel_degree": 2, "microbatches": 2})])), gpus=0)
    assert (plan.parallel.dp, plan.parallel.zero, plan.parallel.shard_group, plan.batch.micro_batch) == (4, 3, 2, 1)
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"smdistributed": {"modelparallel": {"parameters": {"tensor_parallel_degree": 2}}}}))
    argv = [*flags, "--smp", str(path), "--tp", "1"]
    plan = prepare_launch(run_config_from_args(build_parser().parse_args(argv)), gpus=0)
    assert plan.parallel.tp == 1 and plan.parallel.dp == 4  # the explicit flag won
    with pytest.raises(ConfigError, match="neither a JSON object nor a readable JSON file"):
        run_config_from_args(build_parser().parse_args([*flags, "--smp", str(tmp_path / "missing.json")]))
