"""Shared skeleton of the ``transformers`` parity tests (tests/parity/test_<family>_hf.py).

A tiny random HF model, every 1-D parameter and the router's selection bias perturbed (so a
wrong convention cannot hide behind an init), is saved with ``save_pretrained`` and loaded with
``bumblebee.from_hf``; then, each as the family's test asks:

- logits (fp32): ``TOL`` max-abs against HF; gradients after one backward of the same loss:
  every parameter within ``TOL`` of HF's, relative to HF's largest entry;
- ``to_hf`` writes a directory ``transformers`` loads with equal logits (and, where asked,
  bumblebee reads back bit for bit, or the files equal the source's);
- a packed row equals HF run on each document alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import bumblebee

VOCAB = 97
TOL = 1e-4


def perturb(*models, bias: str = "copy") -> None:
    """Every 1-D parameter moved by 0.2 N(0, 1); the router's selection bias set to 0.05 N(0, 1)
    (``bias="add"``: moved by it)."""
    with torch.no_grad():
        for m in models:
            for _, p in m.named_parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    noise = 0.05 * torch.randn_like(b)
                    b.add_(noise) if bias == "add" else b.copy_(noise)


def hf_model(model_cls, config, seed: int, perturb_fn=perturb):
    """``model_cls(config)`` seeded with ``seed``, perturbed, in fp32 eval mode."""
    torch.manual_seed(seed)
    hf = model_cls(config)
    perturb_fn(hf)
    return hf.float().eval()


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def load(hf, path, family: str, **kwargs):
    """``hf`` saved at ``path`` and loaded by bumblebee: of ``family``, with HF's parameter count."""
    hf.save_pretrained(path)
    bb = bumblebee.from_hf(str(path), **kwargs)
    assert bb.family == family
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    return bb


def batch(T: int):
    """(ids, labels) of two random rows of ``T`` tokens."""
    return torch.randint(0, VOCAB, (2, T)), torch.randint(0, VOCAB, (2, T))


def assert_logits_close(logits, ref, what=None) -> None:
    assert (logits - ref).abs().max().item() < TOL, what


def assert_grads_close(pairs, what=None) -> None:
    """Each (name, gradient, HF's gradient) within ``TOL`` of HF's largest entry."""
    for name, g, g_ref in pairs:
        scale = g_ref.abs().max().clamp_min(1e-12)
        assert ((g - g_ref).abs().max() / scale).item() < TOL, (what, name) if what else name


def renamed_grads(bb, hf, to_bumblebee_name):
    """(HF name, bumblebee's gradient, HF's) of every HF parameter, paired by
    ``to_bumblebee_name``, which must name every bumblebee parameter."""
    bb_params, hf_params = dict(bb.named_parameters()), dict(hf.named_parameters())
    assert {to_bumblebee_name(n) for n in hf_params} == set(bb_params)
    return [(n, bb_params[to_bumblebee_name(n)].grad, p.grad) for n, p in hf_params.items()]


def assert_logits_and_grads(bb, hf, T: int, grads, before_hf_backward=None) -> None:
    """Logits of a random batch against HF's, then one backward of the same loss on each;
    ``grads(bb, hf)`` pairs the gradients (``renamed_grads``) for ``assert_grads_close``.
    ``before_hf_backward`` runs between the two backwards (e.g. to swap HF's kernel: HF then
    runs its forward again); without it one HF forward serves the logits and the backward."""
    ids, labels = batch(T)
    with torch.set_grad_enabled(before_hf_backward is None):
        ref = hf(ids).logits
    logits = bb(ids)
    assert_logits_close(logits, ref.detach())
    loss_of(logits, labels).backward()
    if before_hf_backward is not None:
        before_hf_backward()
        ref = hf(ids).logits
    loss_of(ref, labels).backward()
    assert_grads_close(grads(bb, hf))


def assert_to_hf_loads(bb, model_cls, out, T: int, reload: str | None = None, src=None):
    """``to_hf`` into ``out``: ``transformers`` loads it with equal logits. ``reload``:
    bumblebee reads it back bit for bit (``"state_dict"`` or ``"parameters"``); ``src``: the
    written tensors equal those of the directory ``src``, name for name and bit for bit."""
    bumblebee.to_hf(bb, str(out))
    if src is not None:
        a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    back = model_cls.from_pretrained(out).float().eval()
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        assert_logits_close(back(ids).logits, bb(ids))
    if reload is not None:
        reloaded = bumblebee.from_hf(str(out))
        if reload == "state_dict":
            pairs = zip(bb.state_dict().items(), reloaded.state_dict().items())
        else:
            pairs = zip(bb.named_parameters(), reloaded.named_parameters())
        for (n, a), (_, b) in pairs:
            assert torch.equal(a, b), n
        return reloaded
    return None


def assert_packed_rows(bb, hf, lengths) -> None:
    """One row of documents of ``lengths`` (positions restarting at each) equals HF run on each
    document alone."""
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = bb(ids, position_ids=pos)
        ref = torch.cat([hf(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert_logits_close(packed, ref)


def mtp_step(mtp, j, h, pos, ids):
    """HF's MTP depth ``j`` once: ``MtpModel.forward_layer`` where it exists; transformers 5.17's
    ``MtpModel`` has none (only ``forward``, which drafts tokens), so there the body of its
    ``forward`` loop for depth ``j``: embed, rotary, masks, ``layers[j]``, the shared post norm.
    (5.17's multimodal rotary (``mrope_section``: Qwen3.5) indexes [3, B, T] positions where
    later releases broadcast [B, T] text positions themselves: given them broadcast.)"""
    if hasattr(mtp, "forward_layer"):
        return mtp.forward_layer(j, h, pos, None, input_ids=ids)
    embeds, rotary = mtp.embed_tokens(ids), mtp.rotary_emb
    rope = None
    if rotary is not None:
        grid = pos[None].expand(3, -1, -1) if hasattr(rotary, "mrope_section") else pos
        rope = rotary(embeds, position_ids=grid)
    masks = mtp.create_masks_for_mtp_layer(j, embeds, None, pos)
    h = mtp.layers[j](
        embeds, h, position_embeddings=rope, position_ids=pos, past_key_values=None, **masks
    )
    return mtp.shared_post_norm(h) if mtp.use_shared_post_norm else h
