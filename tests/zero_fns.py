"""Rank functions for the ZeRO tests."""

import contextlib
import io

import torch
from dp_fns import Net, data, make_optimizer
from torch import nn

from parcourse import zero
from parcourse.data import shard as shard_rows
from parcourse.experiments.data_parallel import backward_in_microsteps


def factory(opt_name):
    return lambda params: make_optimizer(opt_name, params)


def local_batch(ctx, batch):
    """This rank's rows of the shared regression batch."""
    x, y = data(batch)
    return shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)


def fit(model, opt, x, y, steps):
    """`steps` steps of MSE on (x, y); the losses."""
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(ctx, stage, opt_name, steps, batch, bucket_mb=0.0005):
    model = Net()
    if ctx.rank != 0:  # ZeRO must broadcast rank 0's weights first
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    zmodel, opt = zero.shard(
        model, factory(opt_name), stage=stage, group=ctx.group, bucket_mb=bucket_mb
    )
    fit(zmodel, opt, *local_batch(ctx, batch), steps)
    state_numel = sum(
        t.numel()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return zmodel.full_state_dict(), state_numel


def resume(ctx, stage, steps_before, steps_after, batch):
    """Train, save model + sharded optimizer, rebuild from the checkpoint, go on."""
    x, y = local_batch(ctx, batch)
    zmodel, opt = zero.shard(Net(), factory("adam"), stage=stage, group=ctx.group, bucket_mb=0.0005)
    fit(zmodel, opt, x, y, steps_before)
    checkpoint = io.BytesIO()
    torch.save({"model": zmodel.full_state_dict(), "opt": opt.state_dict()}, checkpoint)
    fit(zmodel, opt, x, y, steps_after)
    uninterrupted = zmodel.full_state_dict()

    checkpoint.seek(0)
    saved = torch.load(checkpoint)
    fresh = Net()
    with torch.no_grad():  # other weights than saved: the load must replace them all
        for p in fresh.parameters():
            p.add_(1.0)
    zmodel2, opt2 = zero.shard(
        fresh, factory("adam"), stage=stage, group=ctx.group, bucket_mb=0.0005
    )
    zmodel2.load_full_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    fit(zmodel2, opt2, x, y, steps_after)
    return uninterrupted, zmodel2.full_state_dict()


def drop_in(ctx, opt_name, steps, batch):
    """ZeroOptimizer under our NaiveDataParallel, like ZeroRedundancyOptimizer under DDP."""
    from parcourse.data_parallel import NaiveDataParallel
    from parcourse.zero import ZeroOptimizer

    model = Net()
    ddp = NaiveDataParallel(model, ctx.group)
    cls, kw = (
        (torch.optim.Adam, {"lr": 0.01})
        if opt_name == "adam"
        else (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    )
    opt = ZeroOptimizer(ddp.parameters(), cls, group=ctx.group, **kw)
    fit(ddp, opt, *local_batch(ctx, batch), steps)
    return {k: v.clone() for k, v in model.state_dict().items()}, opt.local_state_bytes()


def mixed(ctx, stage, steps, batch, dtype):
    """SGD under ZeRO with 16-bit compute; returns fp32 masters and what forward saw."""
    seen = []
    model = Net()
    model.inp.register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, out.dtype)))
    zmodel, opt = zero.shard(
        model,
        factory("sgd"),
        stage=stage,
        group=ctx.group,
        mixed_precision=getattr(torch, dtype),
        bucket_mb=0.0005,
    )
    losses = fit(zmodel, opt, *local_batch(ctx, batch), steps)
    masters = {str(p.dtype) for p in opt.shard_params}
    dtypes = sorted({str(d) for pair in seen for d in pair})
    return zmodel.full_state_dict(), losses, dtypes, masters


def accumulate(ctx, stage, microsteps, batch):
    """Gradient shards after `microsteps` backward passes, all but the last under no_sync();
    None where a parameter has none on this rank."""
    zmodel, _ = zero.shard(Net(), factory("sgd"), stage=stage, group=ctx.group, bucket_mb=0.0005)
    backward_in_microsteps(zmodel, *local_batch(ctx, batch), microsteps)
    return [None if p.grad is None else p.grad.clone() for p in zmodel.parameters()]


# --- real training loops (param groups, accumulation, a plain optimizer, tied weights)


class TinyGPT(nn.Module):
    """Token embedding tied to the LM head (as GPT-2), a LayerNorm and an MLP: the
    shapes a GPT gives ZeRO, with rows (vocab 11, width 6) that no world size divides."""

    def __init__(self, vocab=11, width=6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        h = h + self.mlp(h)
        logits = self.head(self.ln(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tokens(batch, seed=2):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 11, (batch, 5), generator=g)
    return t, t.roll(-1, dims=1)


def adamw_groups(named):
    """nanoGPT's split: decay matrices, not biases or norms; each group its own lr."""
    named = list(named)
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1, "lr": 0.02},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 0.005},
    ]


def step_loss(model, kind, x, y):
    if kind == "gpt":
        return model(x, y)
    return nn.functional.mse_loss(model(x), y)


def make_model(kind):
    return TinyGPT() if kind == "gpt" else Net()


def make_batch(kind, batch):
    return tokens(batch) if kind == "gpt" else data(batch)


def one_process(kind, steps, batch, world_size, microsteps=1, clip=None, norm_type=2.0):
    """One process, the same loss as the ranks together: per step, the mean over
    ranks of their microsteps' losses (each scaled by 1/microsteps)."""
    model = make_model(kind)
    opt = torch.optim.AdamW(adamw_groups(model.named_parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = make_batch(kind, batch)
    for _ in range(steps):
        total = 0.0
        for r in range(world_size):
            xs, ys = shard_rows(x, r, world_size), shard_rows(y, r, world_size)
            for xm, ym in zip(xs.chunk(microsteps), ys.chunk(microsteps)):
                total = total + step_loss(model, kind, xm, ym) / microsteps
        (total / world_size).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fsdp2_loop(
    ctx,
    kind,
    stage,
    steps,
    batch,
    microsteps=1,
    no_sync=False,
    keep_ln=False,
    mixed_precision=None,
    clip=None,
    algorithm="auto",
    nvme_path=None,
    norm_type=2.0,
    **options,
):
    """As a loop written for FSDP2 would drive it: shard, then an ordinary AdamW with
    param groups over model.named_parameters(), an LR scheduler, accumulation. `options`
    go to ZeroModel (offload, ZeRO++); `nvme_path` wraps the AdamW in an
    InfinityOptimizer (the scheduler stays on the AdamW, whose param groups it steps)."""
    net = make_model(kind)
    keep = [net.ln] if keep_ln else []
    model = zero.ZeroModel(
        net,
        stage,
        ctx.group,
        bucket_mb=0.0005,
        keep_modules=keep,
        compute_dtype=mixed_precision and getattr(torch, mixed_precision),
        algorithm=algorithm,
        **options,
    )
    adamw = torch.optim.AdamW(adamw_groups(model.named_parameters()))
    sched = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    opt = adamw if nvme_path is None else zero.InfinityOptimizer(model, adamw, nvme_path)
    x, y = make_batch(kind, batch)
    x, y = shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        for i, (xm, ym) in enumerate(zip(x.chunk(microsteps), y.chunk(microsteps))):
            skip = no_sync and i < microsteps - 1
            with model.no_sync() if skip else contextlib.nullcontext():
                (step_loss(model, kind, xm, ym) / microsteps).backward()
        if clip is not None:
            model.clip_grad_norm_(clip, norm_type)
        opt.step()
        sched.step()
        opt.zero_grad()
    ln_dtype = str(net.ln.weight.dtype) if kind == "gpt" else None
    return model.full_state_dict(), ln_dtype


def groups_drop_in(ctx, steps, batch):
    """ZeroOptimizer with two param groups and an LR scheduler, under our DDP."""
    from parcourse.data_parallel import NaiveDataParallel
    from parcourse.zero import ZeroOptimizer

    net = Net()
    ddp = NaiveDataParallel(net, ctx.group)
    opt = ZeroOptimizer(adamw_groups(net.named_parameters()), torch.optim.AdamW, group=ctx.group)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data(batch)
    x, y = shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    saved = opt.state_dict()
    fresh = ZeroOptimizer(adamw_groups(net.named_parameters()), torch.optim.AdamW, group=ctx.group)
    fresh.load_state_dict(saved)
    hyper = [(g["lr"], g["weight_decay"]) for g in fresh.param_groups]
    return {k: v.clone() for k, v in net.state_dict().items()}, hyper


def optimizer_before_sharding(ctx, stage):
    """The FSDP mistake: an optimizer over the module's parameters, built before sharding."""
    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    model = zero.ZeroModel(net, stage, ctx.group)
    nn.functional.mse_loss(model(data(8)[0]), data(8)[1]).backward()
    opt.step()


def state_dict_refused(ctx, stage):
    model = zero.ZeroModel(Net(), stage, ctx.group)
    model.state_dict()


def masters_at_start(ctx):
    """For every stage and 16-bit dtype: the weights given to ZeroModel and its
    full_state_dict() right after construction (the fp32 masters, gathered)."""
    out = []
    for stage in (1, 2, 3):
        for dtype in (torch.bfloat16,):  # fp16 is refused: no loss scaling here
            torch.manual_seed(0)  # the same weights on every rank
            model = Net()
            given = {k: v.detach().clone() for k, v in model.state_dict().items()}
            zmodel = zero.ZeroModel(model, stage, ctx.group, compute_dtype=dtype, bucket_mb=0.0005)
            out.append((stage, str(dtype), given, zmodel.full_state_dict()))
    return out


def mixed_one_step(ctx, stage, dtype, lr=0.1):
    """One SGD step under ZeRO with 16-bit compute: the fp32 masters afterwards."""
    torch.manual_seed(0)
    zmodel, opt = zero.shard(
        Net(),
        lambda ps: torch.optim.SGD(ps, lr=lr),
        stage=stage,
        group=ctx.group,
        mixed_precision=getattr(torch, dtype),
        bucket_mb=0.0005,
    )
    x, y = local_batch(ctx, 16)
    nn.functional.mse_loss(zmodel(x), y).backward()
    opt.step()
    return zmodel.full_state_dict()


def mixed_reference(dtype, world_size, lr=0.1, kind="plain"):
    """What mixed precision means, in one process: fp32 masters; each rank's forward and
    backward on the masters cast to 16 bits; the ranks' 16-bit gradients averaged (in
    fp32); an SGD step on the fp32 masters. Returns the masters and the gradients."""
    torch.manual_seed(0)
    master = Net(kind)
    grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    for rank in range(world_size):
        half = Net(kind).to(getattr(torch, dtype))
        half.load_state_dict(
            {k: v.to(getattr(torch, dtype)) for k, v in master.state_dict().items()}
        )
        x, y = data(16)
        x, y = shard_rows(x, rank, world_size), shard_rows(y, rank, world_size)
        loss = nn.functional.mse_loss(half(x.to(half.inp.weight.dtype)).float(), y)
        loss.backward()
        for n, p in half.named_parameters():
            if p.grad is not None:  # Net has a parameter forward never uses
                grads[n] += p.grad.float() / world_size
    with torch.no_grad():
        for n, p in master.named_parameters():
            p -= lr * grads[n]
    return {k: v.detach() for k, v in master.state_dict().items()}, grads


def from_config_train(ctx, config, steps, batch):
    """`steps` optimizer steps of `zero.from_config`'s engine, DeepSpeed's loop: this rank's
    rows cut into micro-batches of `train_micro_batch_size_per_gpu`, one backward each."""
    engine = zero.from_config(Net(), config, ctx.group)
    x, y = local_batch(ctx, batch)
    micro = config["train_micro_batch_size_per_gpu"]
    stepped = 0
    while stepped < steps:
        for xm, ym in zip(x.split(micro), y.split(micro)):
            engine.backward(nn.functional.mse_loss(engine(xm), ym))
            stepped += engine.step()
    return engine.module.full_state_dict()


def from_config_error(ctx, config):
    """The message `zero.from_config` refuses `config` with."""
    try:
        zero.from_config(Net(), config, ctx.group)
    except ValueError as e:
        return str(e)
    return None


def dropped_models_are_freed(ctx):
    """Each wrapper built, stepped and dropped: is it freed (a weak reference dead after
    a collection)? A pool's ranks live on between runs; a wrapper never freed keeps its
    model, optimizer state and communication threads for good."""
    import gc
    import weakref

    from parcourse.data_parallel import BucketedDataParallel, NaiveDataParallel

    makers = {
        "naive": lambda net: NaiveDataParallel(net, ctx.group),
        "bucketed": lambda net: BucketedDataParallel(net, ctx.group),
        **{
            f"zero {s}": (lambda net, s=s: zero.ZeroModel(net, s, ctx.group, bucket_mb=0.0005))
            for s in (1, 2, 3)
        },
    }
    freed = {}
    for name, make in makers.items():
        model = make(Net())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        fit(model, opt, *local_batch(ctx, 8), 2)
        ref = weakref.ref(model)
        del model, opt
        gc.collect()
        freed[name] = ref() is None
    return freed


class Backwards(nn.Module):
    """`head` registered before `body` but called after it: a prefetch that follows the
    registration order gathers a unit forward has not reached yet."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(13, 5)
        self.body = nn.Linear(7, 13)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def load_after_a_forward(ctx):
    """Stage 3 with prefetch: a no_grad forward, then load other weights, then a forward:
    how far the output is from the loaded weights' own."""
    x = data(4, seed=5)[0]
    target = Backwards(seed=1)
    model = zero.ZeroModel(Backwards(seed=0), 3, ctx.group, prefetch=True)
    with torch.no_grad():
        model(x)
        model.load_full_state_dict(target.state_dict())
        return float((model(x) - target(x)).abs().max())


def load_refused(ctx, stage, change):
    """load_full_state_dict given a state with one key too many, or one shape changed:
    the error's text (None if it loaded)."""
    model = zero.ZeroModel(Net(), stage, ctx.group, bucket_mb=0.0005)
    state = model.full_state_dict()
    name = next(iter(state))
    if change == "extra":
        state["extra.weight"] = torch.zeros(3)
    else:
        state[name] = state[name].t().contiguous() if state[name].dim() == 2 else state[name][:1]
    try:
        model.load_full_state_dict(state)
    except (KeyError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def added_group(ctx, batch, world_size=None):
    """SGD over `inp` alone for a step, then `out` added as a group of its own (another
    lr), two more steps; ZeroOptimizer under our DDP, or (ctx None) one process over the
    ranks' rows together. The weights."""
    from parcourse.data_parallel import NaiveDataParallel
    from parcourse.zero import ZeroOptimizer

    net = Net()
    x, y = data(batch)
    if ctx is None:
        model, opt = net, torch.optim.SGD(net.inp.parameters(), lr=0.1)
    else:
        model = NaiveDataParallel(net, ctx.group)
        opt = ZeroOptimizer(net.inp.parameters(), torch.optim.SGD, group=ctx.group, lr=0.1)
        x, y = shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": list(net.out.parameters()), "lr": 0.3})
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in net.state_dict().items()}


class Branches(nn.Module):
    """Two LayerNorms, each rank using one (a branch chosen by the data, as a router's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 13)
        self.ln_a, self.ln_b = nn.LayerNorm(13), nn.LayerNorm(13)
        self.out = nn.Linear(13, 5)
        with torch.no_grad():
            for ln in (self.ln_a, self.ln_b):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x, which):
        h = self.inp(x)
        return self.out(torch.tanh(self.ln_a(h) if which == 0 else self.ln_b(h)))


def kept_branches(ctx, stage, batch, steps=3, world_size=None):
    """Branches with both LayerNorms kept whole, rank r using ln_a if r is even; SGD.
    With ctx None, one process over the ranks' rows, the same loss. The weights."""
    net = Branches()
    x, y = data(batch)
    if ctx is None:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(steps):
            sum(
                nn.functional.mse_loss(
                    net(shard_rows(x, r, world_size), r % 2), shard_rows(y, r, world_size)
                )
                for r in range(world_size)
            ).div(world_size).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in net.state_dict().items()}
    model = zero.ZeroModel(
        net, stage, ctx.group, bucket_mb=0.0005, keep_modules=[net.ln_a, net.ln_b]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)
    for _ in range(steps):
        nn.functional.mse_loss(model(xs, ctx.rank % 2), ys).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def module_called_itself(ctx, stage):
    """After a step, the module called itself (as FSDP2's loops do), then the wrapper:
    the two outputs."""
    net = Net()
    model = zero.ZeroModel(net, stage, ctx.group, bucket_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = local_batch(ctx, 8)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        x = data(4, seed=5)[0]
        return net(x), model(x)


def frozen_midway(ctx, how, batch=16, steps=4, world_size=2):
    """Adam; after two steps `inp` is frozen through the wrapper's named_parameters()
    ("shards") or the module's own ("module"). ctx None: one process, the module's. The
    weights."""
    net = Net()
    x, y = data(batch)
    if ctx is None:
        model, named = net, net.named_parameters
    else:
        stage = int(how[-1])
        model = zero.ZeroModel(net, stage, ctx.group, bucket_mb=0.0005)
        named = model.named_parameters if how.startswith("shards") else net.named_parameters
        x, y = shard_rows(x, ctx.rank, ctx.world_size), shard_rows(y, ctx.rank, ctx.world_size)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        if step == 2:
            for name, p in named():
                if "inp" in name:
                    p.requires_grad_(False)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = model.full_state_dict() if ctx is not None else net.state_dict()
    return {k: v.detach().clone() for k, v in out.items()}


def thawed_after_wrapping(ctx, kind):
    """`inp` frozen when wrapped (our DDP, or ZeRO-1), then unfrozen: the first forward."""
    from parcourse.data_parallel import NaiveDataParallel

    net = Net()
    net.inp.requires_grad_(False)
    model = (
        NaiveDataParallel(net, ctx.group) if kind == "ddp" else zero.ZeroModel(net, 1, ctx.group)
    )
    net.inp.requires_grad_(True)
    model(data(4)[0])


def rewrapped_after_unfreezing(ctx, kind):
    """`inp` frozen when wrapped (our DDP, or ZeRO-1), a step, the wrapper dropped, `inp`
    unfrozen and the module wrapped again (as the refusal says to): under DDP `inp`'s
    gradient after a backward, which must be the same on every rank (ZeRO: None)."""
    import gc

    from parcourse.data_parallel import NaiveDataParallel

    def wrap(net):
        return (
            NaiveDataParallel(net, ctx.group)
            if kind == "ddp"
            else zero.ZeroModel(net, 1, ctx.group)
        )

    net = Net()
    net.inp.requires_grad_(False)
    x, y = local_batch(ctx, 8)
    model = wrap(net)
    nn.functional.mse_loss(model(x), y).backward()
    del model
    gc.collect()
    net.inp.requires_grad_(True)
    for p in net.parameters():
        p.grad = None
    model = wrap(net)
    nn.functional.mse_loss(model(x), y).backward()
    if kind != "ddp":  # each rank holds its own rows' gradient: the forward ran, unrefused
        return None
    return net.inp.weight.grad.clone()


def mixed_one_step_frozen(ctx, stage, dtype, lr=0.1):
    """One SGD step under ZeRO with 16-bit compute, the hidden layer frozen before
    wrapping: the dtype its forward saw, the export, and the export once reloaded and
    run again (the frozen weight's 16-bit copy made again from what was loaded)."""
    torch.manual_seed(0)
    seen = []
    model = Net("frozen")
    model.hidden.register_forward_hook(lambda m, a, out: seen.append(str(m.weight.dtype)))
    zmodel, opt = zero.shard(
        model,
        lambda ps: torch.optim.SGD(ps, lr=lr),
        stage=stage,
        group=ctx.group,
        mixed_precision=getattr(torch, dtype),
        bucket_mb=0.0005,
    )
    x, y = local_batch(ctx, 16)
    nn.functional.mse_loss(zmodel(x), y).backward()
    opt.step()
    state = zmodel.full_state_dict()
    doubled = {k: v * 2 if k.startswith("hidden.") else v for k, v in state.items()}
    zmodel.load_full_state_dict(doubled)
    with torch.no_grad():
        out = zmodel(x)
    return seen, {str(p.dtype) for p in model.hidden.parameters()}, state, doubled, x, out


def offloaded_state_in_the_other_rank(ctx, rows):
    """`from_config` with the optimizer offloaded, one step on a Linear of `rows` output
    rows (even: every rank's shard alike in shape; odd: not), then each rank's optimizer
    state loaded into the next rank's optimizer: what that says (None: it loaded). Its own
    state loads."""
    import torch.distributed as dist

    config = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "train_micro_batch_size_per_gpu": 4,
    }
    torch.manual_seed(0)
    engine = zero.from_config(nn.Linear(8, rows), config, ctx.group)
    engine.backward(engine(torch.randn(4, 8)).square().sum())
    engine.step()
    mine = engine.optimizer.state_dict()
    states = [None] * ctx.world_size
    dist.all_gather_object(states, mine, group=ctx.group)
    try:
        engine.optimizer.load_state_dict(states[(ctx.rank + 1) % ctx.world_size])
        said = None
    except ValueError as e:
        said = str(e)
    engine.optimizer.load_state_dict(mine)
    return said


# --- fp16 with loss scaling (torch's GradScaler / ShardedGradScaler over the course's ZeRO)

FP16_SCALER = {"init_scale": 2.0**20, "growth_interval": 2}  # overflows at first: skips


def _plant_inf(params, plant, step, rank):
    """After backward: an inf in the first gradient this rank holds, at `plant` =
    (step, rank) (a rank's own rows under ZeRO, every row in one process)."""
    if plant is not None and plant == (step, rank):
        first = next(p for p in params if p.grad is not None and p.grad.numel())
        first.grad.view(-1)[0] = float("inf")


def fp16_scaled(ctx, stage, steps, scaler="sharded", plant=None):
    """`steps` SGD steps of ZeRO `stage` with fp16 compute and dynamic loss scaling:
    torch's ShardedGradScaler over the group ("sharded") or a plain torch.amp.GradScaler
    ("plain"). `plant`: (step, rank) whose gradient rows get an inf after backward.
    Returns the masters whole and the scale before each step and after the last."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    zmodel = zero.ZeroModel(Net(), stage, ctx.group, compute_dtype=torch.float16, bucket_mb=0.0005)
    opt = torch.optim.SGD(zmodel.parameters(), lr=0.1)
    if scaler == "sharded":
        scaling = ShardedGradScaler("cpu", process_group=ctx.group, **FP16_SCALER)
    else:
        scaling = torch.amp.GradScaler("cpu", **FP16_SCALER)
    x, y = local_batch(ctx, 16)
    scales = []
    for step in range(steps):
        scales.append(scaling.get_scale())
        scaling.scale(nn.functional.mse_loss(zmodel(x), y)).backward()
        _plant_inf(zmodel.parameters(), plant, step, ctx.rank)
        scaling.step(opt)
        scaling.update()
        opt.zero_grad()
    return zmodel.full_state_dict(), [*scales, scaling.get_scale()]


class DeepSpeedRules:
    """torch.amp.GradScaler's interface on a `zero.LossScale` (DeepSpeed's rules, worked
    by hand in tests/test_zero.py), for one process's loop."""

    def __init__(self, **kwargs):
        self.rules, self.found = zero.LossScale(**kwargs), False

    def get_scale(self):
        return self.rules.scale

    def scale(self, loss):
        return loss * self.rules.scale

    def step(self, opt):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.found = not all(torch.isfinite(g).all() for g in grads)
        if not self.found:
            for g in grads:
                g.div_(self.rules.scale)
            opt.step()

    def update(self):
        self.rules.update(self.found)


def fp16_scaled_reference(steps, world_size, plant_step=None, scaling=None, max_norm=None):
    """What fp16 with loss scaling means, in one process with a plain GradScaler: fp32
    masters; each rank's forward and backward of the scaled loss on the masters cast to
    fp16; the ranks' fp16 gradients summed and divided in fp16 (as ZeRO's reduce-scatter
    does), then cast to fp32; the scaler unscales, skips on an inf, steps and updates.
    Returns the masters, the scale before each step and after the last, and the largest
    |gradient| seen.
    `scaling`: another scaler with GradScaler's interface (DeepSpeedRules); `max_norm`:
    clip the unscaled gradients to it (GradScaler only)."""
    torch.manual_seed(0)
    master = Net()
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    scaling = scaling or torch.amp.GradScaler("cpu", **FP16_SCALER)
    x, y = data(16)
    scales, largest = [], 0.0
    for step in range(steps):
        scales.append(scaling.get_scale())
        sums: dict = {}
        for rank in range(world_size):
            half = Net().to(torch.float16)
            half.load_state_dict({k: v.to(torch.float16) for k, v in master.state_dict().items()})
            xr, yr = shard_rows(x, rank, world_size), shard_rows(y, rank, world_size)
            loss = nn.functional.mse_loss(half(xr.to(torch.float16)).float(), yr)
            scaling.scale(loss).backward()
            for n, p in half.named_parameters():
                if p.grad is not None:  # Net has a parameter forward never uses
                    sums[n] = p.grad if n not in sums else sums[n] + p.grad
        for n, p in master.named_parameters():
            p.grad = (sums[n] / world_size).float() if n in sums else None
        _plant_inf(master.parameters(), None if plant_step is None else (plant_step, 0), step, 0)
        found = [p.grad for p in master.parameters() if p.grad is not None]
        if all(torch.isfinite(g).all() for g in found):
            largest = max(largest, max(float(g.abs().max()) for g in found) / scales[-1])
        if max_norm is not None:  # unscale first, then clip: GradScaler's documented order
            scaling.unscale_(opt)
            nn.utils.clip_grad_norm_(master.parameters(), max_norm)
        scaling.step(opt)
        scaling.update()
        opt.zero_grad()
    scales.append(scaling.get_scale())
    return {k: v.detach() for k, v in master.state_dict().items()}, scales, largest


def fp16_engine(ctx, stage, steps, plant=None, clipping=None, **fp16):
    """`steps` steps of `zero.from_config`'s engine with DeepSpeed's fp16 section (SGD,
    lr 0.1); `plant` as in `fp16_scaled`. The masters whole, the scale before each step
    and after the last, and the steps skipped."""
    section = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1}
    config = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "fp16": {**section, "hysteresis": 1, **fp16},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if clipping is not None:
        config["gradient_clipping"] = clipping
    torch.manual_seed(0)
    engine = zero.from_config(Net(), config, ctx.group)
    x, y = local_batch(ctx, 16)
    scales = []
    for step in range(steps):
        scales.append(engine.loss_scale.scale)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        _plant_inf(engine.module.parameters(), plant, step, ctx.rank)
        engine.step()
    scales.append(engine.loss_scale.scale)
    return engine.module.full_state_dict(), scales, engine.skipped_steps


class NormedToy(nn.Module):
    """Embedding, RMSNorm, Linear layers and a head, the last token's logits: the model a
    course's FSDP suite trains in fp16 beside one process. Its norms run in fp32."""

    def __init__(self, vocab=100, d_model=64, d_ff=128):
        super().__init__()
        torch.manual_seed(42)
        self.embedding = nn.Embedding(vocab, d_model)
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_ff)
        self.linear1, self.linear2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        x = self.norm1(self.embedding(ids))
        x = self.norm2(torch.relu(self.linear1(x)))
        return self.lm_head(self.linear2(x))[:, -1, :].float()


def toy_batches(steps, batch=20, seq=8, vocab=100):
    torch.manual_seed(123)
    ids, labels = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch,))
    out = []
    for step in range(steps):
        out.append((ids, labels))
        torch.manual_seed(42 + step)
        perm = torch.randperm(batch)
        ids, labels = ids[perm], labels[perm]
    return out


def fp16_unscaled(ctx, stage, steps):
    """fp16 compute with no loss scaling, norms kept in fp32, SGD lr 0.01 on this rank's
    half of each batch: the masters after every step."""
    model = NormedToy()
    zmodel = zero.ZeroModel(
        model,
        stage,
        ctx.group,
        compute_dtype=torch.float16,
        keep_modules=[model.norm1, model.norm2],
    )
    opt = torch.optim.SGD(zmodel.parameters(), lr=0.01)
    after = []
    for ids, labels in toy_batches(steps):
        opt.zero_grad(set_to_none=True)
        ids, labels = (
            shard_rows(ids, ctx.rank, ctx.world_size),
            shard_rows(labels, ctx.rank, ctx.world_size),
        )
        nn.functional.cross_entropy(zmodel(ids), labels).backward()
        opt.step()
        after.append(zmodel.full_state_dict())
    return after


def fp16_unscaled_reference(steps):
    """One process, the whole batch: the Linear and Embedding weights cast to fp16 for
    forward and backward, the norms in fp32 (their inputs cast up, outputs down), fp32
    masters stepped by SGD lr 0.01. The masters after every step."""
    master = NormedToy()
    opt = torch.optim.SGD(master.parameters(), lr=0.01)
    after = []
    for ids, labels in toy_batches(steps):
        half = NormedToy()
        half.load_state_dict(master.state_dict())
        for m in (half.embedding, half.linear1, half.linear2, half.lm_head):
            m.to(torch.float16)
        for m in (half.norm1, half.norm2):
            m.register_forward_pre_hook(lambda m, args: (args[0].float(),))
            m.register_forward_hook(lambda m, args, out: out.to(torch.float16))
        nn.functional.cross_entropy(half(ids), labels).backward()
        for p, q in zip(master.parameters(), half.parameters()):
            p.grad = q.grad.float()
        opt.step()
        after.append({k: v.detach().clone() for k, v in master.state_dict().items()})
    return after
