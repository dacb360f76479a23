"""Mixture of experts: the expert-parallel layer's step against one process and against
torch's all-to-all, its bytes and memory beside the formulas, and the balance of tokens
per expert under each balancing method on the real corpus.

    python benchmarks/experts.py [--tokens 4096] [--width 128] [--rounds 7] [--steps 200]
                                 [--device cpu|cuda] [--only steps|bytes|balance|dualpipe]
                                 [--microbatches 8,16] [--pipeline-steps 4]

1. Step time (forward and backward of one MoE layer, 8 experts, top 2, dropless, fp32,
   one thread a rank): the whole batch of --tokens in one process (the batched layer,
   every expert) against expert parallelism on 2 and 4 ranks, each with its share of the
   tokens and its share of the experts; the tokens dispatched by the course's all-to-all
   (send / recv) and, beside it, by torch's `all_to_all_single` (same layer otherwise).
   Each configuration takes turns with the others, median of --rounds, slowest rank.
   Target: ep 2 <= 0.75 of one process (each rank computes half the experts' rows).
   `--device cuda`: on the GPU, the ranks sharing it (gloo: the course's all-to-all and
   torch's both carry the rows through the host; a GPU each, torch's runs on NCCL).
2. Bytes one rank sends in the layer's forward and backward, counted message by message,
   tokens routed evenly, beside `theory.moe_all_to_all_bytes`; the experts' weights and
   Adam's state a rank holds beside `theory.expert_bytes`.
3. Balance: a GPT with 8 experts (top 2) trained --steps steps on the corpus (Python's
   standard library, `python -m parcourse train`'s), one process, with no balancing, with
   Switch's auxiliary loss (0.01) and with DeepSeek-V3's bias (rate 1e-3): over the last
   quarter of the steps, the busiest expert's tokens over the mean, and at ep 4 the
   busiest rank's rows over the mean (what the slowest rank's expert time is, relative).
4. DualPipe against 1F1B with the experts' traffic (`experiments.experts.hidden_traffic`):
   4 ranks, two pipelines of 2, the course's GPT (4 blocks of d_model 32, 8 experts, top
   2, dropless) with each MoE layer's experts cut over the two ranks holding the same
   stages (ep 2), the all-to-all over a simulated link (3 ms, 0.05 GB/s), compute
   simulated (a stage's forward 30 ms and backward 60 ms of a microbatch, padded piece by
   piece between its all-to-alls, so that four ranks on two cores behave as four
   devices). For each number of microbatches: 1F1B, DualPipe with its pairs run one after
   the other, and DualPipe with its pairs overlapped (two threads taking turns on the
   rank: one's all-to-all while the other computes). Per step, the mean over the ranks of
   the all-to-all waited for and the part of it exposed (the rank computing nothing),
   the median over the steps after the first; beside it what the simulator predicts from
   1F1B's measured actions (`predicted_exposure`). Target: DualPipe overlapped exposes
   <= 50% of what 1F1B exposes.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from parcourse import Pool
from parcourse.comm import Comm
from parcourse.experiments.experts import hidden_traffic, traffic_summary
from parcourse.experts import MoE, Routing, expert_parallel, run_expert_parallel
from parcourse.memory import format_bytes
from parcourse.pipeline.schedule import schedule_by_name
from parcourse.theory import moe_all_to_all_bytes

EXPERTS, TOP_K = 8, 2


def _layer(width: int) -> MoE:
    torch.manual_seed(0)
    return MoE(width, EXPERTS, TOP_K)


def step_times(ctx: Any, tokens: int, width: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of one forward and backward: the whole batch in one process ("one"), and
    this rank's share over the group by the course's all-to-all ("ours") and torch's
    ("torch"), taking turns."""
    from parcourse.experiments.timing import take_turns

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    whole = torch.randn(tokens, width, generator=g).to(ctx.device)
    mine = whole[: tokens // ctx.world_size].clone()
    one = _layer(width).to(ctx.device)
    ours = expert_parallel(_layer(width).to(ctx.device), Comm(ctx.group, algorithm="ring"))
    theirs = expert_parallel(_layer(width).to(ctx.device), Comm(ctx.group, algorithm="torch"))

    def run(layer: MoE, x: torch.Tensor) -> None:
        x = x.clone().requires_grad_()
        layer(x).square().mean().backward()
        layer.zero_grad(set_to_none=True)

    return take_turns(
        ctx.group,
        {
            "one": lambda _: run(one, whole),
            "ours": lambda _: run(ours, mine),
            "torch": lambda _: run(theirs, mine),
        },
        rounds,
        device=torch.device(ctx.device),
    )


def bytes_and_memory(ctx: Any, tokens: int, width: int) -> dict[str, int]:
    """Bytes this rank sends in one layer's forward and backward, tokens routed evenly
    (token t to experts t and t + 1, mod 8), and the experts' weights and Adam's state
    it holds after a step."""
    from parcourse.memory import storage_bytes, tensors_in
    from parcourse.trace import Tracer

    tracer = Tracer(ctx.rank)
    layer = expert_parallel(_layer(width), Comm(ctx.group, tracer=tracer, algorithm="ring"))
    x = torch.randn(tokens, width, requires_grad=True)
    chosen = (torch.arange(tokens)[:, None] + torch.arange(TOP_K)) % EXPERTS
    routing = Routing(
        chosen,
        torch.full((tokens, TOP_K), 0.5),
        torch.ones_like(chosen, dtype=torch.bool),
        torch.bincount(chosen.flatten(), minlength=EXPERTS),
        torch.zeros(()),
        torch.zeros(()),
    )

    def sent() -> int:
        return int(sum(c.value for c in tracer.data().counters if c.name == "bytes_sent"))

    out = run_expert_parallel(layer, x, routing)
    forward = sent()
    out.square().mean().backward()
    backward = sent() - forward
    experts = [layer.up_weight, layer.up_bias, layer.down_weight, layer.down_bias]
    opt = torch.optim.Adam(experts, lr=1e-3)
    opt.step()
    return {
        "forward": forward,
        "backward": backward,
        "params": storage_bytes(experts),
        "optimizer": storage_bytes(tensors_in(list(opt.state.values()))) - 4 * len(experts),
    }  # less Adam's step counters (4 bytes a tensor)


def balance(corpus_dir: str, steps: int, method: str) -> dict[str, float]:
    """A small GPT with 8 experts trained `steps` steps on the corpus, one process: the
    busiest expert's tokens over the mean, and at ep 4 the busiest rank's, over the last
    quarter of the steps (every block's router, summed)."""
    from parcourse.corpus import ShardedLoader, open_corpus
    from parcourse.experts import moe_layers, update_bias
    from parcourse.models import GPTConfig, gpt

    settings = {
        "none": {"aux_loss": 0.0},
        "aux loss": {"aux_loss": 0.01},
        "bias": {"aux_loss": 0.0, "bias_rate": 1e-3},
    }[method]
    config = GPTConfig(
        vocab=256,
        block_size=64,
        n_layers=2,
        n_heads=4,
        d_model=64,
        experts=EXPERTS,
        top_k=TOP_K,
        **settings,
    )
    torch.manual_seed(0)
    model = gpt(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = ShardedLoader(open_corpus(corpus_dir).train, 64, 16, seed=0)
    counts = torch.zeros(EXPERTS)
    for step in range(steps):
        x, y = loader.next()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        update_bias(model)
        opt.step()
        opt.zero_grad()
        if step >= steps - steps // 4:
            for m in moe_layers(model):
                counts += m.last.counts.float()  # type: ignore[union-attr]
    per_rank = counts.view(4, -1).sum(1)
    return {
        "expert": float(counts.max() / counts.mean()),
        "rank": float(per_rank.max() / per_rank.mean()),
        "loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--corpus", default="runs/corpus")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where section 1's layers run (cuda: the ranks share the GPU)",
    )
    parser.add_argument("--only", choices=("steps", "bytes", "balance", "dualpipe"), default=None)
    parser.add_argument(
        "--microbatches",
        default="8,16",
        help="section 4: the numbers of microbatches a step (even, >= 4)",
    )
    parser.add_argument(
        "--pipeline-steps",
        type=int,
        default=4,
        help="section 4: steps of each schedule (the first not counted)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    steps, counted, balanced, piped = (
        args.only in (None, part) for part in ("steps", "bytes", "balance", "dualpipe")
    )
    try:
        args.microbatches = [int(m) for m in args.microbatches.split(",")]
    except ValueError:
        parser.error(f"--microbatches: numbers separated by commas, got {args.microbatches!r}")
    if any(m < 4 or m % 2 for m in args.microbatches):
        parser.error(
            f"--microbatches: DualPipe on 2 ranks needs an even number >= 4, got "
            f"{args.microbatches}"
        )
    if args.pipeline_steps < 2:
        parser.error(
            f"--pipeline-steps must be >= 2 (the first is not counted), got {args.pipeline_steps}"
        )
    for name in ("tokens", "width", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tokens % 4:
        parser.error(f"--tokens must divide by 4 (ranks' shares), got {args.tokens}")

    if steps:
        step_table(args)
    if counted:
        bytes_table(args)
    if balanced:
        balance_table(args)
    if piped:
        dualpipe_table(args)


def step_table(args: argparse.Namespace) -> None:
    where = (
        "one thread a rank"
        if args.device == "cpu"
        else f"on {torch.cuda.get_device_name(0)}, the ranks sharing it"
    )
    print(
        f"1. one MoE layer ({EXPERTS} experts, top {TOP_K}, d_model {args.width}, hidden "
        f"{4 * args.width}), forward and backward of {args.tokens} tokens, fp32, {where}; "
        f"median of {args.rounds}, slowest rank"
    )
    print(
        f"{'ranks':>6} {'one process':>12} {'ep, ours':>10} {'ep, torch a2a':>14} "
        f"{'ours / one':>11} {'ours / torch':>13} {'target':>7}"
    )
    for ep in (2, 4):
        with Pool(ep, timeout=600, device=args.device) as pool:
            per_rank = pool.run(step_times, args.tokens, args.width, args.rounds).results
        med = {
            k: statistics.median(max(ts) for ts in zip(*(r[k] for r in per_rank)))
            for k in ("one", "ours", "torch")
        }
        ratio = med["ours"] / med["one"]
        target = ("met" if ratio <= 0.75 else "MISSED") if ep == 2 else ""
        print(
            f"{ep:>6} {1e3 * med['one']:>10.1f}ms {1e3 * med['ours']:>8.1f}ms "
            f"{1e3 * med['torch']:>12.1f}ms {ratio:>11.2f} "
            f"{med['ours'] / med['torch']:>13.2f} {target:>7}"
        )


def bytes_table(args: argparse.Namespace) -> None:
    print(
        f"\n2. bytes a rank sends in one layer's step ({args.tokens} tokens a rank, "
        "routed evenly) and what it holds, measured beside theory"
    )
    print(
        f"{'ep':>4} {'forward':>12} {'backward':>12} {'theory':>8} {'expert weights':>15} "
        f"{'Adam':>10} {'theory':>8}"
    )
    for ep in (2, 4):
        with Pool(ep, timeout=600) as pool:
            got = pool.run(bytes_and_memory, args.tokens, args.width).results
        want = moe_all_to_all_bytes(args.tokens, TOP_K, args.width, ep, EXPERTS)
        per_expert = 4 * (2 * 4 * args.width * args.width + 5 * args.width)
        equal = all(
            (r["forward"], r["backward"]) == (want["forward"], want["backward"]) for r in got
        )
        holds = all(
            r["params"] == EXPERTS // ep * per_expert and r["optimizer"] == 2 * r["params"]
            for r in got
        )
        r = got[0]
        print(
            f"{ep:>4} {format_bytes(r['forward']):>12} {format_bytes(r['backward']):>12} "
            f"{'equal' if equal else 'DIFFERS':>8} {format_bytes(r['params']):>15} "
            f"{format_bytes(r['optimizer']):>10} {'equal' if holds else 'DIFFERS':>8}"
        )


def balance_table(args: argparse.Namespace) -> None:
    print(
        f"\n3. balance over the last quarter of {args.steps} steps, GPT 2 x 64 with "
        f"{EXPERTS} experts (top {TOP_K}), the corpus, one process"
    )
    from parcourse.corpus import build_corpus

    corpus = build_corpus(args.corpus)
    print(
        f"{'balancing':>10} {'busiest expert / mean':>22} {'busiest of 4 ranks / mean':>26} "
        f"{'loss':>7}"
    )
    for method in ("none", "aux loss", "bias"):
        b = balance(str(corpus.directory), args.steps, method)
        print(f"{method:>10} {b['expert']:>22.2f} {b['rank']:>26.2f} {b['loss']:>7.3f}")


PIPELINE = {
    "layers": 4,
    "width": 32,
    "experts": EXPERTS,
    "rows": 2,
    "forward_ms": 30.0,
    "backward_ms": 60.0,
    "latency_us": 3000.0,
    "bandwidth_gbps": 0.05,
}


def dualpipe_table(args: argparse.Namespace) -> None:
    print(
        f"\n4. the experts' all-to-all under 1F1B and DualPipe: 4 ranks (2 pipelines of "
        f"2, ep 2 across them), GPT {PIPELINE['layers']} x {PIPELINE['width']} with "
        f"{EXPERTS} experts (top {TOP_K}), compute simulated ({PIPELINE['forward_ms']:.0f} "
        f"ms forward, {PIPELINE['backward_ms']:.0f} ms backward a stage), link "
        f"{PIPELINE['latency_us'] / 1e3:.0f} ms, {PIPELINE['bandwidth_gbps']} GB/s; per "
        f"step, mean over ranks, median of steps 2-{args.pipeline_steps}"
    )
    print(
        f"{'m':>3} {'schedule':<22} {'step':>8} {'all-to-all':>11} {'exposed':>9} "
        f"{'simulator':>10} {'/ 1F1B':>7} {'target':>7}"
    )
    runs = (
        ("1F1B", "1f1b", False),
        ("DualPipe, pairs apart", "dualpipe", False),
        ("DualPipe, overlapped", "dualpipe", True),
    )
    with Pool(4, timeout=600) as pool:
        for m in args.microbatches:
            measured, base = None, None
            for label, name, overlap in runs:
                schedule = schedule_by_name(name, 2, m, 1)
                got = pool.run(
                    hidden_traffic, schedule, overlap, steps=args.pipeline_steps, **PIPELINE
                ).results
                if measured is None:
                    measured = [r["segments"] for r in got]
                mean = traffic_summary(got, schedule, measured, overlap)
                base = mean["exposed"] if base is None else base
                ratio = mean["exposed"] / base
                target = ("met" if ratio <= 0.5 else "MISSED") if overlap else ""
                print(
                    f"{m:>3} {label:<22} {1e3 * mean['step']:>6.0f}ms "
                    f"{1e3 * mean['waited']:>9.1f}ms {1e3 * mean['exposed']:>7.1f}ms "
                    f"{1e3 * mean['simulated']:>8.1f}ms {ratio:>7.2f} {target:>7}"
                )


if __name__ == "__main__":
    main()
