"""ServerArgs: defaults, validation messages that name the flag, CLI parsing (including the
published Ling-3.0-flash launch commands), CUDA-graph batch sizes, compatibility-only
``SGLANG_*`` variables and speculative-decoding resolution. The flag audit (no flag without
effect), the flags that change nothing here, CPU thread defaults, ``--config`` files and the
HTTP-visible flags are in test_server_flags.py."""
from __future__ import annotations

import argparse
import logging
import shlex

import pytest
import torch

from sglang.srt import server_args as server_args_module
from sglang.srt.configs import engine_defaults
from sglang.srt.environ import envs
from sglang.srt.server_args import (
    PortArgs,
    ServerArgs,
    prepare_server_args,
    warn_compat_flags,
)

# Published upstream-SGLang launch commands for Ling-3.0-flash (environment variables and the
# launcher stripped).
NEXTN_COMMAND = """
    --model-path inclusionAI/Ling-3.0-flash
    --tp-size 4 --trust-remote-code
    --speculative-algorithm NEXTN
    --speculative-num-steps 5
    --speculative-eagle-topk 1
    --speculative-num-draft-tokens 6
    --attention-backend trtllm_mla
    --flashinfer-allreduce-fusion-backend auto
    --mem-fraction-static 0.85
"""
DSPARK_COMMAND = """
    --model-path inclusionAI/Ling-3.0-flash
    --tp-size 4 --trust-remote-code
    --speculative-algorithm DSPARK
    --speculative-draft-model-path inclusionAI/Ling-3.0-flash-dspark
    --attention-backend trtllm_mla
    --flashinfer-allreduce-fusion-backend auto
    --disable-radix-cache
"""
ON_CUDA = torch.cuda.is_available()
DEFAULT_BACKEND = "triton" if ON_CUDA else "torch_native"


def test_defaults():
    a = ServerArgs()
    assert a.model_path is None and a.tokenizer_path is None
    assert (a.host, a.port, a.tp_size) == ("127.0.0.1", 30000, 1)
    assert a.dtype == "auto" and a.device == "auto" and a.load_format == "auto"
    assert a.chunked_prefill_size == 8192
    assert a.mem_fraction_static == 0.85
    assert a.decode_log_interval == 40 and a.stream_interval == 1
    assert a.speculative_algorithm is None and a.speculative_num_steps is None
    assert a.max_running_requests is None
    assert a.attention_backend == DEFAULT_BACKEND
    assert a.kda_prefill_impl == "auto" and a.flashinfer_allreduce_fusion_backend is None
    assert a.chat_template is None and a.cpu_num_threads is None and a.watchdog_timeout == 300
    assert not a.enable_metrics and not a.log_requests and a.log_requests_level == 2
    assert isinstance(a.random_seed, int)
    assert a.served_model_name  # bundled model's name when no --model-path
    assert a.url() == "http://127.0.0.1:30000"
    if not ON_CUDA:
        assert a.resolved_device() == "cpu"
        assert a.resolved_dtype() == torch.float32
        assert a.disable_cuda_graph  # CUDA graphs cannot exist on CPU


def test_cli_defaults_match_dataclass_defaults():
    cli = prepare_server_args([])
    direct = ServerArgs(random_seed=cli.random_seed)
    assert cli == direct


def test_dtype_and_device_resolution():
    assert ServerArgs(dtype="bfloat16").resolved_dtype() == torch.bfloat16
    assert ServerArgs(dtype="half").resolved_dtype() == torch.float16
    assert ServerArgs(device="cpu").resolved_device() == "cpu"
    assert ServerArgs(device="cpu").resolved_dtype() == torch.float32
    assert ServerArgs(device="cpu", attention_backend="triton").attention_backend == "triton"


def test_chunked_prefill_minus_one_disables():
    assert ServerArgs(chunked_prefill_size=-1).chunked_prefill_size == -1


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"tp_size": 0}, "--tp-size"),
        ({"mem_fraction_static": 1.0}, "--mem-fraction-static must be in (0, 1)"),
        ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
        ({"chunked_prefill_size": 0}, "--chunked-prefill-size must be -1 or > 0"),
        ({"chunked_prefill_size": -2}, "--chunked-prefill-size"),
        ({"port": 0}, "--port"),
        ({"port": 70000}, "--port"),
        ({"context_length": 0}, "--context-length"),
        ({"max_running_requests": 0}, "--max-running-requests"),
        ({"max_total_tokens": -5}, "--max-total-tokens"),
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs"),
        ({"cuda_graph_bs": [0, 2]}, "--cuda-graph-bs must be a non-empty list of integers >= 1"),
        ({"cuda_graph_bs": []}, "--cuda-graph-bs"),
        ({"cuda_graph_bs": [1, 2.5]}, "--cuda-graph-bs"),
        ({"cuda_graph_bs": 4}, "--cuda-graph-bs"),
        ({"cuda_graph_bs": [1, 8, 16], "cuda_graph_max_bs": 4},
         "--cuda-graph-bs 8, 16 exceeds --cuda-graph-max-bs 4"),
        ({"stream_interval": 0}, "--stream-interval"),
        ({"decode_log_interval": 0}, "--decode-log-interval"),
        ({"watchdog_timeout": 0}, "--watchdog-timeout"),
        ({"dtype": "int8"}, "--dtype"),
        ({"device": "tpu"}, "--device"),
        ({"load_format": "gguf"}, "--load-format"),
        ({"log_level": "loud"}, "--log-level"),
        ({"kda_prefill_impl": "cuda"}, "--kda-prefill-impl"),
        ({"moe_runner_backend": "deep_gemm"}, "--moe-runner-backend"),
        ({"flashinfer_allreduce_fusion_backend": "nccl"}, "--flashinfer-allreduce-fusion-backend"),
        ({"flashinfer_allreduce_fusion_backend": "trtllm"},
         "--flashinfer-allreduce-fusion-backend trtllm: this engine has no FlashInfer"),
        ({"flashinfer_allreduce_fusion_backend": "mnnvl"}, "only 'auto' is accepted"),
        ({"cpu_num_threads": 0}, "--cpu-num-threads must be an integer >= 1"),
        ({"cpu_num_threads": 1.5}, "--cpu-num-threads"),
        ({"log_requests_level": 4}, "--log-requests-level must be one of 0, 1, 2, 3"),
        ({"log_requests_level": True}, "--log-requests-level"),
        ({"chat_template": "no-such-template"}, "--chat-template no-such-template: no such file"),
        ({"chat_template": ""}, "--chat-template"),
        ({"json_model_override_args": "{bad"}, "--json-model-override-args"),
        ({"json_model_override_args": "[1]"}, "--json-model-override-args"),
        ({"attention_backend": "flashinfer"}, "--attention-backend flashinfer"),
        ({"attention_backend": "fa3"}, "--attention-backend fa3"),
        ({"attention_backend": "nope"}, "--attention-backend"),
        ({"speculative_algorithm": "EAGLE3"}, "--speculative-algorithm"),
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"speculative_num_steps": 3}, "--speculative-num-steps needs --speculative-algorithm"),
        ({"speculative_draft_model_path": "x"}, "--speculative-draft-model-path"),
    ],
)
def test_validation_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError) as e:
        ServerArgs(**kwargs)
    assert flag in str(e.value)


def test_attention_backend_error_lists_supported_values():
    with pytest.raises(ValueError) as e:
        ServerArgs(attention_backend="flashinfer")
    assert "torch_native" in str(e.value) and "triton" in str(e.value)


@pytest.mark.skipif(ON_CUDA, reason="checks the no-GPU error")
def test_device_cuda_without_gpu_is_rejected():
    with pytest.raises(ValueError, match="--device cuda"):
        ServerArgs(device="cuda")


@pytest.mark.skipif(ON_CUDA, reason="checks the no-GPU error")
def test_fla_prefill_needs_cuda():
    with pytest.raises(ValueError, match="--kda-prefill-impl fla"):
        ServerArgs(kda_prefill_impl="fla")


@pytest.mark.skipif(ON_CUDA, reason="checks the no-GPU error")
def test_triton_moe_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--moe-runner-backend triton needs CUDA"):
        ServerArgs(moe_runner_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(moe_runner_backend="triton").moe_runner_backend == "triton"


def test_trtllm_mla_is_served_by_the_default_backend():
    assert ServerArgs(attention_backend="trtllm_mla").attention_backend == DEFAULT_BACKEND


# ---------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--tp-size", "0"], "--tp-size"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--attention-backend", "flashmla"], "--attention-backend"),
        (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),
        (["--dtype", "int4"], "--dtype"),  # rejected by argparse choices
        (["--port", "abc"], "--port"),  # rejected by argparse type
        (["--cuda-graph-bs", "1", "x"], "--cuda-graph-bs"),  # rejected by argparse type
        (["--cuda-graph-bs"], "--cuda-graph-bs"),  # nargs="+" needs at least one size
        (["--cuda-graph-bs", "0"], "--cuda-graph-bs"),
        (["--cuda-graph-bs", "8", "--cuda-graph-max-bs", "4"], "--cuda-graph-bs 8 exceeds"),
        (["--flashinfer-allreduce-fusion-backend", "trtllm"], "--flashinfer-allreduce-fusion-backend"),
        (["--log-requests-level", "5"], "--log-requests-level"),  # argparse choices
        (["--cpu-num-threads", "0"], "--cpu-num-threads"),
        (["--chat-template", "/no/such/file.jinja"], "--chat-template /no/such/file.jinja"),
    ],
)
def test_cli_errors_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_parses_common_flags():
    a = prepare_server_args(shlex.split(
        "--model-path ling-3.0-flash --load-format dummy --json-model-override-args "
        "'{\"num_hidden_layers\": 2}' --host 0.0.0.0 --port 31000 --dtype float32 --device cpu "
        "--context-length 4096 --max-running-requests 4 --max-total-tokens 20000 "
        "--chunked-prefill-size -1 --random-seed 7 --disable-cuda-graph --cuda-graph-max-bs 4 "
        "--disable-radix-cache --disable-overlap-schedule --attention-backend torch_native "
        "--log-level warning --skip-server-warmup --stream-interval 2 --served-model-name m "
        "--api-key k --watchdog-timeout 60 --decode-log-interval 10 --enable-metrics "
        "--kda-prefill-impl torch --tokenizer-path tok --chat-template chatml --log-requests "
        "--log-requests-level 3 --cpu-num-threads 3"
    ))
    assert a.model_path == "ling-3.0-flash" and a.load_format == "dummy"
    assert a.json_model_override_args == '{"num_hidden_layers": 2}'
    assert (a.host, a.port, a.dtype, a.device) == ("0.0.0.0", 31000, "float32", "cpu")
    assert (a.context_length, a.max_running_requests, a.max_total_tokens) == (4096, 4, 20000)
    assert a.chunked_prefill_size == -1 and a.random_seed == 7
    assert a.disable_cuda_graph and a.disable_radix_cache and a.disable_overlap_schedule
    assert a.cuda_graph_max_bs == 4 and a.attention_backend == "torch_native"
    assert a.log_level == "warning" and a.skip_server_warmup and a.stream_interval == 2
    assert (a.served_model_name, a.api_key, a.watchdog_timeout) == ("m", "k", 60.0)
    assert a.decode_log_interval == 10 and a.enable_metrics and a.kda_prefill_impl == "torch"
    assert a.resolved_tokenizer_path() == "tok"
    assert a.chat_template == "chatml" and a.log_requests and a.log_requests_level == 3
    assert a.cpu_num_threads == 3 and a.resolved_cpu_num_threads() == 3


def test_upstream_nextn_command_parses_and_validates():
    a = prepare_server_args(NEXTN_COMMAND.split())
    assert a.model_path == "inclusionAI/Ling-3.0-flash"
    assert a.tp_size == 4 and a.trust_remote_code
    assert a.speculative_algorithm == "NEXTN"
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (5, 1, 6)
    assert a.speculative_draft_model_path is None  # the MTP layer comes from the target
    assert a.attention_backend == DEFAULT_BACKEND
    assert a.flashinfer_allreduce_fusion_backend == "auto"
    assert a.mem_fraction_static == 0.85
    # Not upstream's fixed 48: the runner sizes the slots from memory, counting what the
    # algorithm adds per slot, up to SPECULATIVE_MAX_RUNNING_REQUESTS (48).
    assert a.max_running_requests is None
    assert not a.disable_radix_cache


def test_upstream_dspark_command_parses_and_validates():
    a = prepare_server_args(DSPARK_COMMAND.split())
    assert a.speculative_algorithm == "DSPARK"
    assert a.speculative_draft_model_path == "inclusionAI/Ling-3.0-flash-dspark"
    assert a.speculative_num_steps is None and a.speculative_num_draft_tokens is None
    assert a.disable_radix_cache and a.tp_size == 4
    assert a.attention_backend == DEFAULT_BACKEND


# ---------------------------------------------------------------- speculative decoding
def test_nextn_defaults_and_alias():
    a = ServerArgs(speculative_algorithm="nextn")
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (3, 1, 4)
    assert ServerArgs(speculative_algorithm="EAGLE").speculative_algorithm == "NEXTN"
    assert ServerArgs(speculative_algorithm="none").speculative_algorithm is None


def test_nextn_fills_the_missing_half_of_the_chain():
    a = ServerArgs(speculative_algorithm="NEXTN", speculative_num_steps=5)
    assert a.speculative_num_draft_tokens == 6
    b = ServerArgs(speculative_algorithm="NEXTN", speculative_num_draft_tokens=3)
    assert b.speculative_num_steps == 2


def test_explicit_max_running_requests_survives_speculation():
    assert ServerArgs(speculative_algorithm="NEXTN", max_running_requests=2).max_running_requests == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"speculative_num_steps": 5, "speculative_num_draft_tokens": 4},
         "--speculative-num-draft-tokens must equal --speculative-num-steps + 1"),
        ({"speculative_eagle_topk": 2}, "chain"),
        ({"speculative_eagle_topk": 0}, "--speculative-eagle-topk"),
        ({"speculative_num_steps": 0, "speculative_num_draft_tokens": 1}, "--speculative-num-steps"),
        ({"speculative_dspark_block_size": 8}, "--speculative-dspark-block-size is DSPARK-only"),
    ],
)
def test_nextn_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        ServerArgs(speculative_algorithm="NEXTN", **kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # The bundled model carries a dspark/ draft; the dummy Flash preset has none.
        ({"model_path": "ling-3.0-flash", "load_format": "dummy"},
         "--speculative-draft-model-path"),
        ({"speculative_draft_model_path": "d", "speculative_num_steps": 3},
         "--speculative-num-steps is NEXTN-only"),
        ({"speculative_draft_model_path": "d", "speculative_num_draft_tokens": 8},
         "--speculative-num-draft-tokens is NEXTN-only"),
        ({"speculative_draft_model_path": "d", "speculative_eagle_topk": 4}, "--speculative-eagle-topk"),
        ({"speculative_draft_model_path": "d", "speculative_dspark_block_size": 1},
         "--speculative-dspark-block-size"),
    ],
)
def test_dspark_validation(kwargs, message):
    with pytest.raises(ValueError) as e:
        ServerArgs(speculative_algorithm="DSPARK", **kwargs)
    assert message in str(e.value)


def test_dspark_accepts_block_size():
    a = ServerArgs(speculative_algorithm="DSPARK", speculative_draft_model_path="d",
                   speculative_dspark_block_size=8)
    assert a.speculative_dspark_block_size == 8 and a.is_speculative()


def test_cli_nextn_chain_mismatch_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "5",
                             "--speculative-num-draft-tokens", "4"])
    assert e.value.code == 2
    assert "--speculative-num-draft-tokens" in capsys.readouterr().err


# ---------------------------------------------------------------- one source of defaults
def test_defaults_and_choices_come_from_engine_defaults():
    # Re-exported under their old names, as the very same objects.
    for name in ("DTYPE_CHOICES", "KERNEL_BACKEND_CHOICES", "KDA_PREFILL_IMPL_CHOICES",
                 "DEFAULT_MEM_FRACTION_STATIC", "DEFAULT_CHUNKED_PREFILL_SIZE",
                 "SPECULATIVE_MAX_RUNNING_REQUESTS", "SUBSTITUTED_ATTENTION_BACKENDS",
                 "KNOWN_UPSTREAM_ATTENTION_BACKENDS"):
        assert getattr(server_args_module, name) is getattr(engine_defaults, name), name
    assert server_args_module.SUPPORTED_ATTENTION_BACKENDS == ("torch_native", "triton")
    assert engine_defaults.ATTENTION_BACKEND_CHOICES == ("torch_native", "triton")
    assert engine_defaults.DEFAULT_MEM_FRACTION_STATIC == 0.85  # upstream's value
    a = ServerArgs()
    assert a.mem_fraction_static == engine_defaults.DEFAULT_MEM_FRACTION_STATIC
    assert a.chunked_prefill_size == engine_defaults.DEFAULT_CHUNKED_PREFILL_SIZE


@pytest.mark.parametrize("name, dtype", [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
    ("half", torch.float16), ("fp16", torch.float16), ("float32", torch.float32),
    ("float", torch.float32), ("fp32", torch.float32),
])
def test_dtype_table(name, dtype):
    assert engine_defaults.torch_dtype(name) is dtype


def test_dtype_table_rejects_unknown_names_and_covers_the_cli():
    for bad in ("auto", "int8", None):
        with pytest.raises(ValueError, match="unsupported dtype"):
            engine_defaults.torch_dtype(bad)
    for name in engine_defaults.DTYPE_CHOICES:
        if name != "auto":
            assert ServerArgs(dtype=name).resolved_dtype() == engine_defaults.torch_dtype(name)


# ---------------------------------------------------------------- CUDA graphs
def test_cuda_graph_flags_parse():
    a = prepare_server_args(["--cuda-graph-bs", "4", "1", "2"])
    assert a.cuda_graph_bs == [4, 1, 2]
    assert a.cuda_graph_max_bs == 4  # upstream: the largest listed size when not given
    assert a.cuda_graph_batch_sizes() == [1, 2, 4]
    b = prepare_server_args(["--cuda-graph-bs", "1", "2", "--cuda-graph-max-bs", "6"])
    assert b.cuda_graph_max_bs == 6 and b.cuda_graph_batch_sizes() == [1, 2, 6]
    assert prepare_server_args([]).cuda_graph_bs is None


def test_cuda_graph_default_buckets():
    a = ServerArgs()
    assert a.cuda_graph_max_bs == 64
    assert a.cuda_graph_batch_sizes() == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert ServerArgs(cuda_graph_max_bs=20).cuda_graph_batch_sizes() == [1, 2, 4, 8, 12, 16, 20]
    assert ServerArgs(cuda_graph_max_bs=1).cuda_graph_batch_sizes() == [1]
    capped = ServerArgs(max_running_requests=5)
    assert capped.cuda_graph_max_bs == 5 and capped.cuda_graph_batch_sizes() == [1, 2, 4, 5]
    spec = ServerArgs(speculative_algorithm="NEXTN")
    assert spec.cuda_graph_max_bs == 16
    assert spec.cuda_graph_batch_sizes() == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert ServerArgs(cuda_graph_bs=[3, 1, 3]).cuda_graph_batch_sizes() == [1, 3]


def test_default_cuda_graph_batch_sizes_match_upstream_steps():
    sizes = engine_defaults.default_cuda_graph_batch_sizes(600)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert 256 in sizes and 264 not in sizes and 272 in sizes and 496 in sizes
    assert 512 in sizes and 544 in sizes and sizes[-1] == 600
    spec = engine_defaults.default_cuda_graph_batch_sizes(300, speculative=True)
    assert spec[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert 36 not in spec and 40 in spec and 44 in spec and 68 not in spec and 72 in spec
    assert 288 in spec and spec[-1] == 300 and spec == sorted(set(spec))
    with pytest.raises(ValueError, match="cuda graph max batch size"):
        engine_defaults.default_cuda_graph_batch_sizes(0)


@pytest.mark.skipif(ON_CUDA, reason="checks the CPU default")
def test_cuda_graphs_are_off_without_cuda_whatever_the_flags():
    a = ServerArgs(cuda_graph_bs=[1, 2])
    assert a.disable_cuda_graph and a.cuda_graph_batch_sizes() == [1, 2]


def _help_of(flag: str) -> str:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        if flag in action.option_strings:
            return action.help or ""
    raise AssertionError(f"{flag} is not registered")


def test_cuda_graph_and_overlap_help_says_what_the_flags_do():
    assert "eagerly (no CUDA graph capture)" in _help_of("--disable-cuda-graph")
    assert "no host run-ahead" in _help_of("--disable-overlap-schedule")
    assert _help_of("--cuda-graph-max-bs").startswith("Largest batch size captured")
    assert _help_of("--cuda-graph-bs").startswith("Batch sizes to capture")


# ---------------------------------------------------------------- compatibility-only variables
@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    """Forget which compatibility variables this process already warned about; capture new
    warnings."""
    from sglang.srt import environ

    monkeypatch.setattr(server_args_module, "_NO_OP_LOGGED", set())
    monkeypatch.setattr(environ, "_COMPAT_WARNED", set())
    for f in environ.compat_env_fields():
        monkeypatch.delenv(f.name, raising=False)
    caplog.set_level(logging.WARNING)
    return caplog


def _compat_records(caplog, name):
    return [r for r in caplog.records if name in r.getMessage() and "no effect" in r.getMessage()]


def test_compat_env_var_warns_once_at_start_up(fresh_warnings, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_FUSED_KDA_VERIFY", "1")
    a = ServerArgs()
    ServerArgs()
    envs.SGLANG_OPT_FUSED_KDA_VERIFY.get()  # a later read does not warn again
    assert len(_compat_records(fresh_warnings, "SGLANG_OPT_FUSED_KDA_VERIFY")) == 1
    assert warn_compat_flags(a) == ["SGLANG_OPT_FUSED_KDA_VERIFY"]


def test_compat_env_var_typo_fails_at_start_up(fresh_warnings, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH", "ture")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_FUSED_VERIFY_EXTEND_GRAPH"):
        ServerArgs()


# ---------------------------------------------------------------- ports
def test_port_args_are_fresh_ipc_endpoints():
    a = ServerArgs()
    p, q = PortArgs.init_new(a), PortArgs.init_new(a)
    names = [p.tokenizer_ipc_name, p.scheduler_input_ipc_name, p.detokenizer_ipc_name,
             p.rpc_ipc_name, p.metrics_ipc_name]
    assert all(n.startswith("ipc://") for n in names)
    assert len(set(names + [q.tokenizer_ipc_name])) == len(names) + 1
    assert 0 < p.nccl_port < 65536
    assert len(p.ipc_paths()) == 5
