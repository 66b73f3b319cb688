"""The stack on one CUDA GPU, side by side in one run (`make bench-gpu`):

    python bench/bench_gpu.py --out var/bench-gpu

Two Llama-shaped Hydra checkpoints with random weights, built here in bfloat16 (speed
does not depend on the weights): SmolLM2-135M's shape and a 1B-class shape (hidden 2048,
16 layers, MLP 8192), both with SmolLM2's 49,152-token vocabulary and tokenizer
(`--tokenizer`, a folder holding `tokenizer.json`), each split as a trunk and 3 heads.
Per model, bfloat16, greedy or sampled at T = 0.8, `--new-tokens` per request:

- `transformers` `generate` on the same GPU and dtype (the anchor), 1, 8 and 64 rows;
- hydra-jury's bare loop (trunk and one head, argmax fed back, no engine) and the
  fraction it reaches of the bytes roofline (weights read per token over the GPU's
  measured copy bandwidth, bytes read plus written);
- the engine in-process, non-speculative (a jury of one) and speculative PoE (head0
  drafts γ=4 for a jury of two), its workers' steps replayed from CUDA graphs, and
  non-speculative with graphs off: tokens/s and host synchronisations per round;
- `serve` and the split stack (trunk and two jury shards on the same GPU) at 1, 8 and 64
  concurrent sessions: aggregate tokens/s;
- where a bare step's time goes: kernel time and kernel count (PyTorch's profiler)
  against the step's wall time; the rest is launch and Python overhead.

The heads of a checkpoint built from one model are copies of its top layers, so the
speculative rows accept almost every draft: their acceptance is an upper bound, and the
demo checkpoint's own (docs/benchmarks.md, CPU) is what real heads give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.request
import warnings
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
from bench_drafters import SETS  # this folder is on the path of `python bench/...`
from bench_round import bytes_per_token
from bench_serving import measure
from round_profile import DEVICE_PHASES, PHASES, REST, PhaseProfiler

from hydra_jury.hydra_model import HydraModel
from hydra_jury.hydra_model.build.builder import BuildOptions, build_checkpoint
from hydra_jury.hydra_model.checkpoint import CHAT_TEMPLATE_FILE, TOKENIZER_FILES
from hydra_jury.hydra_model.graphs import MODE_VARIABLE, DecodeGraph
from hydra_jury.orchestrator.engine import Engine
from hydra_jury.orchestrator.launcher import LocalStack
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest
from hydra_jury.orchestrator.sessions.redis_server import free_port
from hydra_jury.workers.sessions import SessionLimits

SHAPES = {
    "llama-1b-shaped": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        trunk_layers=12,
    ),
    "smollm2-135m-shaped": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        trunk_layers=26,
    ),
}
PROMPT = "Write a short story about a robot who learns to paint."
COPY_BYTES = 1 << 30


def describe() -> dict:
    properties = torch.cuda.get_device_properties(0)
    return {
        "gpu": properties.name,
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_bandwidth": copy_bandwidth(),
        "launch_seconds": launch_seconds(),
    }


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (best of 10,
    timed with events)."""
    source = torch.randn(COPY_BYTES // 4, device="cuda")
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * COPY_BYTES / best


def build(name: str, root: Path, tokenizer: Path) -> tuple[Path, Path]:
    """A random bfloat16 Llama of `name`'s shape saved with the tokenizer, and the Hydra
    checkpoint built from it (trunk and 3 heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[name])
    trunk_layers = shape.pop("trunk_layers")
    source, checkpoint = root / f"{name}-source", root / name
    if not (checkpoint / "hydra.json").exists():
        config = LlamaConfig(
            vocab_size=49152,
            head_dim=64,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            **shape,
        )
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(source))
        del model
        for file in (*TOKENIZER_FILES, CHAT_TEMPLATE_FILE):
            if (tokenizer / file).exists():
                shutil.copy(tokenizer / file, source / file)
        options = BuildOptions(
            source=str(source),
            out=str(checkpoint),
            trunk_layers=trunk_layers,
            heads=3,
            dtype="bfloat16",
            force=True,
        )
        build_checkpoint(options, log=lambda line: None)
    return source, checkpoint


def prompt_ids(model: HydraModel) -> list[int]:
    return model.load_tokenizer().encode(PROMPT)


def transformers_rate(source: Path, prompt: list[int], rows: int, new_tokens: int) -> float:
    """Tokens/s of `generate`, greedy, `rows` copies of the prompt in one batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16).cuda()
    inputs = torch.tensor([prompt] * rows, device="cuda")

    def generate(count: int, model=model) -> None:
        model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
        )

    generate(8)
    torch.cuda.synchronize()
    began = time.perf_counter()
    generate(new_tokens)
    torch.cuda.synchronize()
    rate = rows * new_tokens / (time.perf_counter() - began)
    del model
    torch.cuda.empty_cache()
    return rate


def bare_steps(model: HydraModel, prompt: list[int], new_tokens: int, graph: bool, profile: bool):
    """The bare greedy loop (trunk and head0, argmax fed back, no engine), eager or
    replayed from a CUDA graph (`DecodeGraph`): seconds per step after the prompt's, the
    tokens, and with `profile` the kernels' summed time and count per step."""
    head = model.heads.select(0)
    capacity = len(prompt) + new_tokens
    trunk_cache, head_cache = model.trunk_cache(capacity), model.head_cache(1, capacity)
    decoder = DecodeGraph(model.trunk, head, trunk_cache, head_cache) if graph else None
    tokens = torch.tensor(prompt, device=model.device)
    hidden = model.trunk.forward(tokens, trunk_cache, 0)
    token = head.forward(hidden, head_cache, 0)[0, -1:].argmax(-1)
    made = [token]
    start = len(prompt)
    torch.cuda.synchronize()

    def steps(count: int) -> None:
        nonlocal token, start
        for _ in range(count):
            if graph:
                logits = decoder.step(token, start)
            else:
                hidden = model.trunk.forward(token, trunk_cache, start)
                logits = head.forward(hidden, head_cache, start)
            token = logits[0, -1:].argmax(-1)
            made.append(token)
            start += 1

    if graph:
        # A first use of each span records its graph (eager runs, then the capture): a
        # rehearsal over every position the run reaches keeps recording out of the timing.
        steps(new_tokens)
        for cache in (trunk_cache, head_cache):
            cache.truncate(len(prompt))
        token, start = made[0], len(prompt)
        del made[1:]
    steps(4)
    torch.cuda.synchronize()
    count = new_tokens - 8
    began = time.perf_counter()
    steps(count)
    torch.cuda.synchronize()
    result = {"rate": count / (time.perf_counter() - began)}
    if profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            steps(4)
            torch.cuda.synchronize()
        kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        result["kernel_seconds"] = sum(e.device_time for e in kernels) / 1e6 / 4
        result["kernels"] = len(kernels) / 4
    result["tokens"] = torch.cat(made).tolist()
    return result


def launch_seconds() -> float:
    """The host's time to launch one small kernel: 2,000 in-place adds, queued back to back."""
    x = torch.zeros(16, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / 2000


def engine_run(model: HydraModel, request: GenerationRequest) -> dict:
    """One request in-process: tokens/s, host synchronisations per round (PyTorch's sync
    debug mode counts each), accepted drafts per round, and where a round's wall time
    goes (`round_profile`, with the device's phases), in ms a round."""
    engine = Engine(LocalBackend(model, limits=SessionLimits(1, 1024)), model.load_tokenizer())
    engine.generate(request)  # records the graphs of every span the request reaches
    torch.cuda.synchronize()
    began = time.perf_counter()
    output = engine.generate(request)
    rate = len(output.token_ids) / (time.perf_counter() - began)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        counted = engine.generate(request)
        torch.cuda.set_sync_debug_mode(0)
    rounds = counted.stats["rounds"]
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    profiler = PhaseProfiler({**PHASES, **DEVICE_PHASES})
    with profiler.installed():
        began = time.perf_counter()
        profiled = engine.generate(request)
        wall = time.perf_counter() - began
    per_round = {
        phase: 1e3 * seconds / profiled.stats["rounds"]
        for phase, seconds in profiler.shares(wall).items()
    }
    return {
        "rate": rate,
        "syncs_per_round": syncs / rounds,
        "accepted_per_round": counted.stats["accepted"] / rounds,
        "round_ms": per_round,
    }


# The modes, in-process (greedy) and served (sampled): a request's options.
MODES = {
    "non-speculative": {"rule": "verifier_only", "jury": ["head0"]},
    "speculative γ=4": {
        "rule": "exact",
        "drafter": "head",
        "draft_head": "head0",
        "jury": ["head1", "head2"],
        "gamma": 4,
    },
}
SERVER_ARGS = ["--device", "cuda", "--max-sessions", "64", "--max-session-tokens", "512"]


def requests(new_tokens: int) -> dict[str, GenerationRequest]:
    common = dict(prompt=PROMPT, max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    return {mode: GenerationRequest(**common, **options) for mode, options in MODES.items()}


def served(checkpoint: Path, servers: list[str], counts: list[int], new_tokens: int) -> dict:
    """Aggregate tokens/s through `serve` and the split stack at each session count."""
    from bench_one_host import start_server

    rates: dict = {}
    if "serve" in servers:
        port = free_port()
        args = [*SERVER_ARGS, "--max-concurrency", "64", "--metrics-port", str(port)]
        child = start_server(str(checkpoint), args)
        try:
            if not child.address:
                raise RuntimeError(child.failure)
            print("serve:", flush=True)
            rates["serve"] = over_modes(child.address, counts, new_tokens, port)
        finally:
            child.process.terminate()
            child.process.wait(timeout=60)
    if "split" in servers:
        stack = LocalStack(
            str(checkpoint),
            shards=2,
            port=0,
            extra_service_args=SERVER_ARGS,
            orchestrator_args=["--max-concurrency", "64"],
            host_turn=False,  # their batches run on the GPU, not on the host's cores
        )
        try:
            address = stack.start()
            print("split stack:", flush=True)
            rates["split"] = over_modes(address, counts, new_tokens)
        finally:
            stack.stop()
    return rates


def batch_totals(metrics_port: int) -> dict[str, list[float]]:
    """Per RPC, from a server's metrics: its batches, their seconds and their calls so far."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    fields = {
        "hydrajury_batch_seconds_count": 0,
        "hydrajury_batch_seconds_sum": 1,
        "hydrajury_batch_calls_sum": 2,
    }
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in fields:
                totals[sample.labels["rpc"]][fields[sample.name]] = sample.value
    return totals


def batches_between(before: dict, after: dict, wall: float) -> dict:
    """Each RPC's batches between two `batch_totals`: ms a batch and calls a batch; and
    the share of `wall` the batches took (the model thread's busy time)."""
    shares = {}
    for rpc, now in after.items():
        count, seconds, calls = (a - b for a, b in zip(now, before[rpc], strict=True))
        if count:
            shares[rpc] = {"ms": 1e3 * seconds / count, "calls": calls / count}
    busy = sum(after[rpc][1] - before[rpc][1] for rpc in after)
    return {"rpcs": shares, "busy": busy / wall}


def over_modes(
    address: str, counts: list[int], new_tokens: int, metrics_port: int | None = None
) -> dict:
    """Aggregate tokens/s per mode and session count, each measured twice: the first
    pass records the CUDA graphs its batch sizes and spans need (`cold`), the second
    replays them (`warm`, the steady state). With the server's `metrics_port`, also its
    batches during the second pass (`batches_between`)."""
    prompts = SETS["open"]  # free chat
    measure(address, 2, 1, 8, MODES["non-speculative"], prompts)  # warm-up
    rates: dict = {}
    for mode, options in MODES.items():
        for n in counts:
            cold = measure(address, n, 1, new_tokens, options, prompts)[0]
            before = batch_totals(metrics_port) if metrics_port else None
            began = time.perf_counter()
            warm = measure(address, n, 1, new_tokens, options, prompts)[0]
            wall = time.perf_counter() - began
            rates.setdefault(mode, {})[n] = {"cold": cold, "warm": warm}
            print(f"  served {mode}, {n} sessions: {cold:.0f} cold, {warm:.0f} warm")
            if before is not None:
                batches = batches_between(before, batch_totals(metrics_port), wall)
                rates[mode][n]["batches"] = batches
                print(f"    {describe_batches(batches)}")
    return rates


def describe_batches(batches: dict) -> str:
    rpcs = "; ".join(
        f"{rpc} {b['ms']:.2f} ms a batch of {b['calls']:.1f} calls"
        for rpc, b in batches["rpcs"].items()
    )
    return f"{rpcs}; batches {batches['busy']:.0%} of the wall time"


def run_model(name: str, root: Path, tokenizer: Path, args) -> dict:
    source, checkpoint = build(name, root, tokenizer)
    model = HydraModel.load(checkpoint, device="cuda")
    prompt = prompt_ids(model)
    result: dict = {"dtype": str(model.dtype).removeprefix("torch.")}
    result["bytes_per_token"] = bytes_per_token(model, 1)
    result["bare"] = bare_steps(model, prompt, args.new_tokens, graph=False, profile=True)
    print(f"  bare loop, eager: {result['bare']['rate']:.1f} tokens/s")
    result["graphed"] = bare_steps(model, prompt, args.new_tokens, graph=True, profile=False)
    print(f"  bare loop, CUDA graph: {result['graphed']['rate']:.1f} tokens/s")
    del model
    torch.cuda.empty_cache()
    result["transformers"] = {}
    for rows in args.sessions:
        result["transformers"][rows] = transformers_rate(source, prompt, rows, args.new_tokens)
        print(f"  transformers generate, {rows} rows: {result['transformers'][rows]:.1f}")
    model = HydraModel.load(checkpoint, device="cuda")
    cases = requests(args.new_tokens)
    result["engine"] = {}
    for mode, request in cases.items():
        result["engine"][mode] = engine_run(model, request)
        print(f"  engine, {mode}: {result['engine'][mode]['rate']:.1f} tokens/s")
    # The same engine launching every kernel from Python (workers made inside).
    with mock.patch.dict(os.environ, {MODE_VARIABLE: "off"}):
        eager = engine_run(model, cases["non-speculative"])
    result["engine"]["non-speculative, graphs off"] = eager
    print(f"  engine, graphs off: {eager['rate']:.1f} tokens/s", flush=True)
    del model
    torch.cuda.empty_cache()
    result["served"] = served(checkpoint, args.servers, args.sessions, args.served_tokens)
    return result


def agreement(first: list[int], second: list[int]) -> int:
    """How many tokens two greedy runs share before they part."""
    shared = min(len(first), len(second))  # (a profiled run makes a few more)
    parted = (i for i in range(shared) if first[i] != second[i])
    return next(parted, shared)


def report_machine(machine: dict) -> None:
    print(
        f"\n{machine['gpu']} ({machine['memory_gib']} GiB), torch {machine['torch']}, "
        f"CUDA {machine['cuda']}; copy bandwidth {machine['copy_bandwidth'] / 1e9:.0f} GB/s "
        f"(read + written); one small kernel's launch {machine['launch_seconds'] * 1e6:.1f} µs"
    )


def report(machine: dict, name: str, r: dict, args) -> None:
    roofline = machine["copy_bandwidth"] / r["bytes_per_token"]
    bare, graphed = r["bare"], r["graphed"]
    print(f"\n## {name}, {r['dtype']}: {r['bytes_per_token'] / 1e6:.0f} MB of weights a token")
    print(f"bytes roofline {roofline:.0f} tokens/s\n")
    print("| single stream | tokens/s | × transformers | of roofline |")
    print("| --- | --- | --- | --- |")
    anchor = r["transformers"][1]
    rows = [
        ("transformers generate", anchor),
        ("bare loop, eager", bare["rate"]),
        ("bare loop, CUDA graph", graphed["rate"]),
    ]
    rows += [(f"engine, {mode}", e["rate"]) for mode, e in r.get("engine", {}).items()]
    for label, rate in rows:
        print(f"| {label} | {rate:.1f} | {rate / anchor:.2f} | {rate / roofline:.1%} |")
    print(
        f"\neager bare step: {1e3 / bare['rate']:.2f} ms wall, {bare['kernels']:.0f} kernels "
        f"summing {bare['kernel_seconds'] * 1e3:.2f} ms (the rest is launches and Python); "
        f"CUDA graph step {1e3 / graphed['rate']:.2f} ms"
    )
    same = agreement(bare["tokens"], graphed["tokens"])
    print(f"greedy tokens, graph against eager: the first {same} of {len(graphed['tokens'])} agree")
    for mode, e in r.get("engine", {}).items():
        print(
            f"engine {mode}: {e['syncs_per_round']:.1f} host syncs a round, "
            f"{e['accepted_per_round']:.2f} drafts accepted a round"
        )
    engine = r.get("engine", {})
    print("\n| ms a round, in-process | " + " | ".join(engine) + " |")
    print("| --- " * (len(engine) + 1) + "|")
    for phase in [*PHASES, *DEVICE_PHASES, REST]:
        cells = " | ".join(f"{e['round_ms'][phase]:.2f}" for e in engine.values())
        print(f"| {phase} | {cells} |")
    print("\n| aggregate tokens/s | " + " | ".join(f"{n} sessions" for n in args.sessions) + " |")
    print("| --- " * (len(args.sessions) + 1) + "|")
    print(
        "| transformers generate (rows) | "
        + " | ".join(f"{r['transformers'][n]:.0f}" for n in args.sessions)
        + " |"
    )
    for server, modes in r.get("served", {}).items():
        for mode, rates in modes.items():
            passes = [rates[n] for n in args.sessions]
            cells = " | ".join(f"{p['warm']:.0f} ({p['cold']:.0f})" for p in passes)
            print(f"| {server}, {mode} | {cells} |")
    print("(served: steady state, and in brackets the first pass, which records the graphs)")
    for mode, rates in r.get("served", {}).get("serve", {}).items():
        for n in args.sessions:
            if "batches" in rates[n]:
                print(f"serve, {mode}, {n} sessions: {describe_batches(rates[n]['batches'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="var/bench-gpu", help="models and results.json")
    parser.add_argument("--tokenizer", default="var/models/smollm2-hydra")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--served-tokens", type=int, default=64)
    parser.add_argument("--sessions", default="1,8,64")
    parser.add_argument("--servers", default="serve,split", help="'' for none")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench-gpu needs a CUDA device; this PyTorch sees none")
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.servers = [name for name in args.servers.split(",") if name]
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    machine = describe()
    report_machine(machine)
    results = {}
    for name in args.models.split(","):
        print(f"\n{name}:", flush=True)
        results[name] = run_model(name, root, Path(args.tokenizer), args)
        (root / "results.json").write_text(json.dumps({"machine": machine, **results}, indent=1))
        report(machine, name, results[name], args)


if __name__ == "__main__":
    main()
