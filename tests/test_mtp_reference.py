"""MTP head vs a float64 numpy reference written from the spec (§5.1-5.2).

transformers has no MTP, so the reference here is independent: numpy, float64, its own RMSNorm,
RoPE, gated attention and SwiGLU. The target hidden states it consumes come from transformers'
own model (post-final-norm `last_hidden_state`), so the test also pins which hidden state feeds
the MTP.
"""

import numpy as np
import torch

import hf_fixtures as hx
import mtpjax


def rms1p(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, pos, rd, theta):
    inv = theta ** (-np.arange(0, rd, 2) / rd)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    xr, xp = x[..., :rd], x[..., rd:]
    rot = np.concatenate([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return np.concatenate([xr * cos[:, None] + rot * sin[:, None], xp], -1)


def mtp_reference(w, embed, lm_head, h, tokens, cfg):
    """w: dict of float64 mtp.* arrays; h [T, H] target post-norm hidden; tokens [T]."""
    T = h.shape[0] - 1
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e = rms1p(embed[tokens[1:]], w["mtp.pre_fc_norm_embedding.weight"])
    hh = rms1p(h[:-1], w["mtp.pre_fc_norm_hidden.weight"])
    x = np.concatenate([e, hh], -1) @ w["mtp.fc.weight"].T
    pos = np.arange(T, dtype=np.float64)
    L = "mtp.layers.0."
    a = rms1p(x, w[L + "input_layernorm.weight"])
    qg = (a @ w[L + "self_attn.q_proj.weight"].T).reshape(T, nq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (a @ w[L + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (a @ w[L + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q = rope(rms1p(q, w[L + "self_attn.q_norm.weight"]), pos, cfg.rotary_dim, cfg.rope_theta)
    k = rope(rms1p(k, w[L + "self_attn.k_norm.weight"]), pos, cfg.rotary_dim, cfg.rope_theta)
    G = nq // nkv
    o = np.zeros((T, nq, hd))
    mask = np.tril(np.ones((T, T), bool))
    for head in range(nq):
        s = q[:, head] @ k[:, head // G].T / np.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o[:, head] = p @ v[:, head // G]
    o = o.reshape(T, nq * hd) * (1 / (1 + np.exp(-gate.reshape(T, nq * hd))))
    x = x + o @ w[L + "self_attn.o_proj.weight"].T
    m = rms1p(x, w[L + "post_attention_layernorm.weight"])
    x = x + (silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T)) @ w[L + "mlp.down_proj.weight"].T
    return rms1p(x, w["mtp.norm.weight"]) @ lm_head.T


def test_mtp_logits_match_float64_reference(tmp_path):
    m, mtp = hx.write_checkpoint(str(tmp_path), seed=4)
    cfg, params = mtpjax.load_checkpoint(str(tmp_path), dtype="float32")
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 23))
    out = np.asarray(mtpjax.mtp_logits(cfg, params, tokens))
    assert out.shape == (2, 22, cfg.vocab_size)
    w = {k: v.astype(np.float64) for k, v in mtp.items()}
    sd = {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
    with torch.no_grad():
        hid = m.model(torch.tensor(tokens)).last_hidden_state.double().numpy()
    for b in range(2):
        ref = mtp_reference(w, sd["model.embed_tokens.weight"], sd["lm_head.weight"], hid[b],
                            tokens[b], cfg)
        np.testing.assert_allclose(out[b], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_mtp_reference_detects_swapped_concat_order(tmp_path):
    """The comparison can fail: feeding [hidden, embedding] instead of [embedding, hidden]."""
    m, mtp = hx.write_checkpoint(str(tmp_path), seed=4)
    cfg, params = mtpjax.load_checkpoint(str(tmp_path))
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 12))
    out = np.asarray(mtpjax.mtp_logits(cfg, params, tokens))[0]
    w = {k: v.astype(np.float64) for k, v in mtp.items()}
    H = cfg.hidden_size
    fc = w["mtp.fc.weight"]
    w["mtp.fc.weight"] = np.concatenate([fc[:, H:], fc[:, :H]], 1)
    w["mtp.pre_fc_norm_embedding.weight"], w["mtp.pre_fc_norm_hidden.weight"] = (
        w["mtp.pre_fc_norm_hidden.weight"], w["mtp.pre_fc_norm_embedding.weight"])
    sd = {k: v.detach().double().numpy() for k, v in m.state_dict().items()}
    with torch.no_grad():
        hid = m.model(torch.tensor(tokens)).last_hidden_state.double().numpy()
    # the reference, built with the halves (and their norms) the other way round
    ref_swapped = mtp_reference(w, sd["model.embed_tokens.weight"], sd["lm_head.weight"],
                                hid[0], tokens[0], cfg)
    assert np.abs(out - ref_swapped).max() > 1e-2 * np.abs(ref_swapped).max()
