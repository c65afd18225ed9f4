"""Latency of one static batch without a server: prefill, then decode steps at that context.

    python -m sglang.bench_one_batch --model-path PATH --batch-size 1 --input-len 8192 \\
        --output-len 8 [server args] [--result-filename results.jsonl]

Builds one TP rank's :class:`TpModelWorker` directly (one process per TP rank when
``--tp-size`` > 1), feeds random prompts, times the prefill and each greedy decode step (with a
device synchronize around every timed region on CUDA), prints SGLang's summary lines and appends
one JSON line per (batch size, input len, output len) to ``--result-filename``. Decode steps are
the server's decode rounds: on CUDA replayed from CUDA graphs unless ``--disable-cuda-graph``.

With ``--speculative-algorithm`` (and its flags, as for the server) the rounds are the
algorithm's: each is timed as a decode step, until every request has ``--output-len`` tokens,
and the result also has the mean tokens a round committed per request (``accept_length``);
``median_decode_throughput`` is then tokens per second (``batch x accept length / median
round``). E.g. a DSpark round at Flash width (the 42 layers: the draft reads target layer 35)::

    python -m sglang.bench_one_batch --model-path ling-3.0-flash --load-format dummy \\
        --quantization fp8 --speculative-algorithm DSPARK \\
        --speculative-draft-model-path ling-3.0-flash-dspark --speculative-dspark-block-size 7 \\
        --batch-size 1 --input-len 1024 --output-len 32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, release_kv_cache
from sglang.srt.rounds.contract import RoundWorker
from sglang.srt.rounds.plain import TpModelWorker
from sglang.srt.rounds.registry import get_spec_worker_class
from sglang.srt.model_executor.cuda_graph_runner import capture_batch_sizes
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.prefill_graph_runner import init_prefill_graphs_from_args
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.distributed.parallel_state import free_port
from sglang.srt.layers.kernel_choices import KernelChoices, add_kernel_choices_arg
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import ServerArgumentParser

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchArgs:
    """Benchmark-only flags (SGLang's names)."""

    run_name: str = "default"
    batch_size: List[int] = dataclasses.field(default_factory=lambda: [1])
    input_len: List[int] = dataclasses.field(default_factory=lambda: [1024])
    output_len: List[int] = dataclasses.field(default_factory=lambda: [16])
    result_filename: Optional[str] = None
    skip_warmup: bool = False
    seed: int = 0
    # --kernel-choices: kernels forced for an A/B (layers/kernel_choices.py), e.g. "rmsnorm=0".
    kernel_choices: str = ""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Register the benchmark flags."""
        d = BenchArgs()
        g = parser.add_argument_group("benchmark", "One static batch per (batch size, input "
                                      "length, output length) combination.")
        g.add_argument("--run-name", type=str, default=d.run_name,
                       help="Name stored in each result line.")
        g.add_argument("--batch-size", type=int, nargs="+", default=d.batch_size,
                       help="Batch sizes to time.")
        g.add_argument("--input-len", type=int, nargs="+", default=d.input_len,
                       help="Prompt lengths to time, in tokens.")
        g.add_argument("--output-len", type=int, nargs="+", default=d.output_len,
                       help="Tokens to generate (one prefill, then decode steps).")
        g.add_argument("--result-filename", type=str, default=None,
                       help="Append one JSON line per configuration to this file.")
        g.add_argument("--skip-warmup", action="store_true",
                       help="No untimed warm-up run per prompt length first (the first timed "
                            "run then includes kernel compilation).")
        g.add_argument("--seed", type=int, default=d.seed, help="Seed of the random prompts.")
        add_kernel_choices_arg(g)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "BenchArgs":
        """Build from a parsed namespace."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_worker(server_args: ServerArgs, bench_args: BenchArgs, tp_rank: int,
                 nccl_port: Optional[int]) -> RoundWorker:
    """The round worker: the TP worker, or the ``--speculative-algorithm`` worker over it (built
    as the scheduler builds it), with pools large enough for the largest configuration (and its
    CUDA graphs, unless disabled)."""
    model_config = ModelConfig.from_path(server_args.model_path,
                                         server_args.json_model_override_args)
    spec_cls = get_spec_worker_class(server_args.speculative_algorithm)
    # Validates the draft and sizes what the target reserves for it, before any weights load.
    requirements = None if spec_cls is None else spec_cls.requirements(server_args, model_config)
    bs = max(bench_args.batch_size)
    per_req = max(bench_args.input_len) + max(bench_args.output_len)
    if requirements is not None:
        per_req += requirements.token_headroom  # a round's window past the last token kept
    args = dataclasses.replace(server_args, max_running_requests=bs,
                               max_total_tokens=server_args.max_total_tokens or bs * per_req + 64)
    choices = KernelChoices.parse(bench_args.kernel_choices)
    args.kernel_choices = choices if choices.forced() else None  # read by the runner
    target = TpModelWorker(args, tp_rank, nccl_port, model_config, spec_requirements=requirements)
    worker = target if spec_cls is None else spec_cls(args, target, requirements)
    if not args.disable_cuda_graph and target.device.type == "cuda":
        worker.init_cuda_graphs(capture_batch_sizes(args, bs))
    init_prefill_graphs_from_args(worker, args)
    return worker


def target_worker(worker: RoundWorker) -> TpModelWorker:
    """The TP worker of a round worker (itself for plain decoding)."""
    return getattr(worker, "target_worker", worker)


def run_once(worker: RoundWorker, batch_size: int, input_len: int, output_len: int,
             seed: int) -> Dict[str, Any]:
    """Prefill ``batch_size`` random prompts of ``input_len`` tokens, then greedy decode rounds
    until every request has ``output_len`` tokens (``output_len - 1`` rounds without
    speculation); returns the timings (seconds) and the tokens each round committed per
    request (``accept_lens``)."""
    runner: ModelRunner = target_worker(worker).model_runner
    if input_len + output_len > runner.context_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds the context "
                         f"length {runner.context_len}")
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    reqs = []
    for i in range(batch_size):
        ids = torch.randint(0, vocab, (input_len,), generator=gen).tolist()
        req = Req(f"bench-{i}", None, ids, SamplingParams(max_new_tokens=output_len))
        req.req_pool_idx = runner.req_to_token_pool.alloc(1)[0]
        req.extend_input_len = input_len
        req.kv_committed_slots = []
        reqs.append(req)
    if runner.kda_state_pool is not None and runner.kda_state_pool.layer_ids:
        runner.kda_state_pool.clear_slots([r.req_pool_idx for r in reqs])
    batch = ScheduleBatch.init_new(reqs, runner.req_to_token_pool,
                                   runner.token_to_kv_pool_allocator, runner.device)
    batch.sampling_info = SamplingBatchInfo.from_reqs(
        [SamplingParams(temperature=0.0)] * batch_size, [[]] * batch_size, vocab, runner.device)
    device = runner.device

    _sync(device)
    tic = time.perf_counter()
    # Whole prompts: no prompt token follows a request's extend (a drafter's -1).
    result = worker.prefill(batch.prepare_for_extend(), batch.sampling_info,
                            next_prompt_tokens=[-1] * batch_size)
    next_ids = result.next_token_ids.tolist()
    _sync(device)
    prefill_latency = time.perf_counter() - tic
    batch.commit_forward()
    for r, t in zip(reqs, next_ids):
        r.output_ids.append(t)
    decode_latencies: List[float] = []
    accept_lens: List[int] = []
    n = worker.round_tokens
    while min(len(r.output_ids) for r in reqs) < output_len:
        _sync(device)
        tic = time.perf_counter()
        slots, loc, bound = batch.prepare_for_round(n, worker.round_cache_loc_buffer(batch_size))
        out = worker.forward_round(slots, loc, batch.sampling_info, seq_lens_bound=bound).wait()
        decode_latencies.append(time.perf_counter() - tic)
        surplus = []
        for r, a, toks, loc_row in zip(reqs, out.accept_lens, out.tokens, out.round_cache_loc):
            # As the scheduler: the accepted window's slots are kept, the rest freed.
            r.output_ids.extend(toks)
            r.kv_committed_slots.append(loc_row[:a].clone())
            surplus.append(loc_row[a:])
            r.kv_len += a
            accept_lens.append(a)
        runner.token_to_kv_pool_allocator.free(torch.cat(surplus))
    for r in reqs:
        release_kv_cache(r, runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
    return {"prefill_latency": prefill_latency, "decode_latencies": decode_latencies,
            "accept_lens": accept_lens}


def summarize(run_name: str, batch_size: int, input_len: int, output_len: int,
              timing: Dict[str, Any]) -> Dict[str, Any]:
    """SGLang's result fields for one configuration."""
    prefill = timing["prefill_latency"]
    decodes = timing["decode_latencies"]
    median = statistics.median(decodes) if decodes else 0.0
    total = prefill + sum(decodes)
    accepts = timing.get("accept_lens") or []
    # Tokens a round commits per request: 1 for plain decoding, the accept length otherwise.
    per_round = sum(accepts) / len(accepts) if accepts else 1.0
    return {
        "run_name": run_name, "batch_size": batch_size, "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill, "prefill_throughput": batch_size * input_len / prefill,
        "median_decode_latency": median,
        "median_decode_throughput": batch_size * per_round / median if median > 0 else 0.0,
        "decode_rounds": len(decodes), "accept_length": per_round,
        "total_latency": total,
        "overall_throughput": batch_size * (input_len + output_len) / total,
    }


def _print(result: Dict[str, Any]) -> None:
    print(f"Prefill. latency: {result['prefill_latency']:6.5f} s, "
          f"throughput: {result['prefill_throughput']:9.2f} token/s")
    print(f"Decode.  median latency: {result['median_decode_latency']:6.5f} s, "
          f"median throughput: {result['median_decode_throughput']:9.2f} token/s")
    if result.get("speculative_algorithm"):
        print(f"Rounds.  {result['decode_rounds']}, verify window "
              f"{result['round_tokens']} tokens, accept length: {result['accept_length']:.2f}")
    print(f"Total. latency: {result['total_latency']:6.3f} s, "
          f"throughput: {result['overall_throughput']:9.2f} token/s")


def memory_report(runner: ModelRunner, load_seconds: float,
                  draft: Optional[torch.nn.Module] = None) -> Dict[str, float]:
    """Weight bytes of this rank (and of a speculative ``draft``'s own weights), load time and
    (CUDA) memory held after building the runner."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    out = {"load_time_s": load_seconds, "weight_gb": weights / 2**30}
    if draft is not None:
        out["draft_weight_gb"] = sum(p.numel() * p.element_size()
                                     for p in draft.parameters()) / 2**30
    if runner.device.type == "cuda":
        out["cuda_allocated_after_load_gb"] = torch.cuda.memory_allocated() / 2**30
    return out


def run_rank(server_args: ServerArgs, bench_args: BenchArgs, tp_rank: int,
             nccl_port: Optional[int]) -> List[Dict[str, Any]]:
    """Run every configuration on one TP rank; rank 0 prints and writes the results."""
    tic = time.perf_counter()
    worker = build_worker(server_args, bench_args, tp_rank, nccl_port)
    runner = target_worker(worker).model_runner
    draft_runner = getattr(worker, "draft_runner", None)  # NEXTN's; DSPARK's is a module
    draft = draft_runner.model if draft_runner is not None else getattr(worker, "draft", None)
    memory = memory_report(runner, time.perf_counter() - tic, draft)
    if tp_rank == 0:
        print(", ".join(f"{k}: {v:.2f}" for k, v in memory.items()))
    results = []
    if not bench_args.skip_warmup:
        # One warm-up per prompt length: kernels whose tiles follow the token count (the MoE
        # grouped GEMM's table buckets) compile at their first call, which must not be timed.
        for il in dict.fromkeys(bench_args.input_len):
            run_once(worker, bench_args.batch_size[0], il, min(bench_args.output_len[0], 2),
                     bench_args.seed)
    for bs in bench_args.batch_size:
        for il in bench_args.input_len:
            for ol in bench_args.output_len:
                timing = run_once(worker, bs, il, ol, bench_args.seed)
                result = summarize(bench_args.run_name, bs, il, ol, timing)
                result.update(memory, speculative_algorithm=server_args.speculative_algorithm,
                              round_tokens=worker.round_tokens)
                result["kernel_choices"] = runner.kernel_choices.describe()
                if runner.device.type == "cuda":
                    result["cuda_peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                results.append(result)
                if tp_rank != 0:
                    continue
                print(f"batch_size={bs} input_len={il} output_len={ol}")
                _print(result)
                if bench_args.result_filename:
                    with open(bench_args.result_filename, "a") as f:
                        f.write(json.dumps(result) + "\n")
    return results


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """CLI entry; returns rank 0's results."""
    parser = ServerArgumentParser(prog="python -m sglang.bench_one_batch",
                                  description="Latency of one static batch, without a server.")
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
        bench_args = BenchArgs.from_cli_args(args)
        KernelChoices.parse(bench_args.kernel_choices)  # a bad spelling fails here, not per rank
        for name in ("batch_size", "input_len", "output_len"):
            if any(v < 1 for v in getattr(bench_args, name)):
                raise ValueError(f"--{name.replace('_', '-')} values must be >= 1")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()),
                        format="%(asctime)s %(message)s")
    if server_args.tp_size == 1:
        return run_rank(server_args, bench_args, 0, None)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(server_args, bench_args, r, port))
             for r in range(1, server_args.tp_size)]
    for p in procs:
        p.start()
    try:
        return run_rank(server_args, bench_args, 0, port)
    finally:
        for p in procs:
            p.join()


if __name__ == "__main__":
    main()
