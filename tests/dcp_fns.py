"""Rank functions for distributed checkpoints: train, save midway, resume on any mesh."""

import torch
from hybrid_fns import BATCH, CONFIG

from parcourse.checkpoint import latest, load, save
from parcourse.hybrid import Hybrid
from parcourse.mesh import Mesh
from parcourse.models import gpt


def batch(step, config=CONFIG):
    """The global batch of step `step`: random tokens, the same on every rank and run."""
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, config.vocab, (BATCH, config.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def model_on(ctx, shape, zero=0, schedule="1f1b", config=CONFIG, **kwargs):
    mesh = Mesh(shape, ctx.group) if ctx is not None else None
    return Hybrid(
        gpt(config, seed=0),
        mesh,
        schedule=schedule,
        microbatches=2,
        zero=zero,
        max_norm=1.0,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        **kwargs,
    )


def train_and_save(
    ctx, shape, root, steps, save_at, zero=0, crash_in_commit=False, blocking=True, config=CONFIG
):
    """`steps` steps, saving a checkpoint after `save_at` of them: the losses and the final
    weights. `crash_in_commit`: after the first save, the next one's rank 0 is killed
    between writing and committing (a save killed halfway). `blocking=False`: the save
    is written in the background while the next steps change the weights, and waited
    for only at the end."""
    model = model_on(ctx, shape, zero, config=config)
    losses, pending = [], None
    for step in range(steps):
        if step == save_at:
            pending = save(model, root, step, extra={"corpus": "abc"}, blocking=blocking)
            if crash_in_commit:
                import os
                import signal

                import parcourse.checkpoint as ckpt

                def killed(tmp, final):
                    os.kill(os.getpid(), signal.SIGKILL)

                if ctx.rank == 0:
                    ckpt._commit = killed
                save(model, root, step + 1)
        losses.append(model.step(*batch(step)))
    if not blocking:
        pending.result()
        torch.distributed.barrier()  # rank 0 has committed
    return losses, model.full_state_dict()


def resume(ctx, shape, root, steps, zero=0, expect=None, config=CONFIG):
    """Load the newest checkpoint under `root` into a model on `shape`, train to `steps`:
    the step it resumed at, the losses after it and the final weights."""
    model = model_on(ctx, shape, zero, config=config)
    meta = load(model, latest(root), expect=expect)
    losses = [model.step(*batch(step)) for step in range(meta["step"], steps)]
    return meta["step"], losses, model.full_state_dict()


def frozen_first(ctx, shape, root, steps, save_at, resuming=False):
    """The position embedding frozen after the model was made (the first weight of the
    first stage: it has no optimizer state): train, saving after `save_at` steps; or load
    that and go on. The losses after the save, the final weights, and whether the frozen
    weight stayed as it was (no gradient, so no step and no weight decay)."""
    model = model_on(ctx, shape)
    frozen = model.model.get_parameter("pos_emb.weight").requires_grad_(False)
    before = frozen.detach().clone()
    start = 0
    if resuming:
        start = load(model, latest(root))["step"]
    losses = []
    for step in range(start, steps):
        if step == save_at and not resuming:
            save(model, root, step)
        loss = model.step(*batch(step))
        if step >= save_at:
            losses.append(loss)
    return losses, model.full_state_dict(), torch.equal(frozen.detach(), before)


def freeze_after_zero(ctx):
    """ZeRO-1 made, then a weight frozen: the next step refuses."""
    model = model_on(ctx, {"dp": 2, "pp": 2}, zero=1)
    model.model.get_parameter("pos_emb.weight").requires_grad_(False)
    model.step(*batch(0))


def fp16_model_on(ctx, shape, zero):
    """The GPT computing in fp16 with ZeRO's fp32 masters, stepped through torch's
    ShardedGradScaler over every rank (AdamW, as `model_on`)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(  # grows within a short run
        "cpu", process_group=ctx.group, init_scale=2.0**20, growth_interval=2
    )
    return model_on(ctx, shape, zero, compute_dtype=torch.float16, scaler=scaler)


def fp16_run(ctx, shape, root, steps, zero, save_at=None, resume=False):
    """fp16 with a loss scaler: `steps` steps, saving after `save_at` of them; or resumed
    from the newest checkpoint under `root`. The scale before each step, the losses and
    the masters whole."""
    model = fp16_model_on(ctx, shape, zero)
    start = load(model, latest(root))["step"] if resume else 0
    scales, losses = [], []
    for step in range(start, steps):
        if step == save_at:
            save(model, root, step)
        scales.append(model.precision.scale())
        losses.append(model.step(*batch(step)))
    return scales, losses, model.full_state_dict()
