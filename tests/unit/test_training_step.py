"""Issue 12: the faster training step computes the same loss and gradients as the plain one."""

import torch

from dspark.models.losses import l1_distance, make_blocks, position_weights
from tests.unit.test_block_drafter import _drafter, _tiny_cache


def _plain_loss(model, seq, blocks):
    """The training loss written the plain way: the sequential head slot by slot and the target's
    distribution computed at every block slot (what the step computed before it was sped up)."""
    cfg = model.cfg
    c = model.project_context(seq.features.unsqueeze(0))
    n = len(seq.features)
    ctx_kv = model.context_kv(c, torch.arange(n).unsqueeze(0))
    ctx_ok = torch.arange(n).unsqueeze(0) < blocks.anchors.unsqueeze(1)
    U, h = model.backbone(blocks.anchor_ids, blocks.anchors, ctx_kv, ctx_ok)
    prev = model.to_draft[blocks.prev]
    zs, cs = [], []
    for k in range(cfg.block_size):
        z, cf, _ = model.head_step(U[:, k], h[:, k], prev[:, k], None)
        zs.append(z)
        cs.append(cf)
    z, conf = torch.stack(zs, 1), torch.stack(cs, 1)
    logp = torch.log_softmax(z.float(), -1)
    ht = seq.last_hidden[blocks.hidden_idx].to(model.fc.weight.dtype)
    p_t = torch.exp((ht @ model.lm_head.T).float() - seq.lse[blocks.hidden_idx].unsqueeze(-1))
    l1 = l1_distance(logp.exp(), p_t, (1 - p_t.sum(-1)).clamp(min=0))
    w = position_weights(cfg.block_size).unsqueeze(0) * blocks.valid
    norm = w.sum().clamp(min=1e-8)
    lab = model.to_draft[blocks.labels]
    inv = lab < cfg.draft_vocab_size
    ce = -logp.gather(-1, lab.clamp(max=cfg.draft_vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    ce = (ce * w * inv).sum() / norm
    tv = (l1 * w).sum() / norm
    acc = (1 - 0.5 * l1).clamp(0, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf.float(), acc.detach(), reduction="none")
    return 0.1 * ce + 0.9 * tv + (bce * w).sum() / norm


def test_the_fast_training_step_gives_the_plain_loss_and_gradients(tmp_path):
    loaded, files = _tiny_cache(tmp_path)
    model = _drafter(target=loaded.model)
    model.train()
    from dspark.models.losses import Sequence

    seq = Sequence.load(files[0])
    gen = torch.Generator().manual_seed(3)
    blocks = make_blocks(seq, 64, model.cfg.block_size, gen)  # dense anchors: overlapping blocks
    assert len(torch.unique(blocks.hidden_idx)) < blocks.hidden_idx.numel()
    fast = model.loss(seq, blocks).total
    g_fast = torch.autograd.grad(fast, [p for p in model.parameters() if p.requires_grad])
    plain = _plain_loss(model, seq, blocks)
    g_plain = torch.autograd.grad(plain, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(fast, plain, rtol=1e-10, atol=1e-12)
    for a, b in zip(g_fast, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
