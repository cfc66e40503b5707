"""The fused q/k/v layouts (hf-phi3, hf-gpt-neox, hf-falcon): exact both ways, and the split transformers does.

Round trips are bit for bit in every dtype (bfloat16 included); the rows of the fused tensor are the ones
Phi3Attention, GPTNeoXAttention and FalconAttention (all three Falcon variants: new_decoder_architecture,
multi_query, classic per head) take for q, k and v: each module, loaded with our fused tensors, projects an
input to the q/k/v we compute from the canonical ones, and a split that is off (q and k swapped) does not.
Sizes are tiny and pairwise distinct (E=12, N=3 or 6, K=1/2/3, head_dim 8 != E/N for Phi-3).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from parity import layouts
from parity.contract import renamer

B, T = 2, 5
DTYPES = (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)
# name -> (layout, E, N, K, H, biases)
LAYERS = {
    "phi3": ("hf-phi3", 12, 3, 1, 8, False),
    "neox": ("hf-gpt-neox", 12, 3, 3, 4, True),
    "falcon-new": ("hf-falcon", 12, 6, 2, 2, True),
    "falcon-mq": ("hf-falcon", 12, 3, 1, 4, False),
    "falcon-per-head": ("hf-falcon", 12, 3, 3, 4, True),
}


def canonical(E, N, K, H, bias, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    sd = {"q_proj.weight": rng.standard_normal((N * H, E)), "k_proj.weight": rng.standard_normal((K * H, E)),
          "v_proj.weight": rng.standard_normal((K * H, E)), "out_proj.weight": rng.standard_normal((E, N * H))}
    if bias:
        sd.update({"q_proj.bias": rng.standard_normal(N * H), "k_proj.bias": rng.standard_normal(K * H),
                   "v_proj.bias": rng.standard_normal(K * H), "out_proj.bias": rng.standard_normal(E)})
    return {k: v.astype(dtype) for k, v in sd.items()}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", LAYERS)
def test_fused_layouts_round_trip_bit_for_bit(name, dtype):
    layout, E, N, K, H, bias = LAYERS[name]
    sd = canonical(E, N, K, H, bias, dtype)
    tensors = layouts.to_layout(sd, layout, prefix="blk.", num_heads=N)
    assert all(v.dtype == np.dtype(dtype) for v in tensors.values())
    back = layouts.from_layout(tensors, layout, prefix="blk.", num_heads=N)
    assert sorted(back) == sorted(sd)
    for key in sd:
        assert back[key].dtype == sd[key].dtype and np.array_equal(bits(back[key]), bits(sd[key])), key
    # and the other way: fused tensors drawn at random split and fuse back to themselves
    drawn = {k: np.random.default_rng(1).standard_normal(v.shape).astype(dtype) for k, v in tensors.items()}
    again = layouts.to_layout(layouts.from_layout(drawn, layout, prefix="blk.", num_heads=N), layout, prefix="blk.",
                              num_heads=N)
    assert all(np.array_equal(bits(again[k]), bits(drawn[k])) for k in drawn)


def test_falcon_s_variants_are_the_formulas_of_its_modeling_code():
    """multi_query: [Q (N*H) | K (H) | V (H)]; classic: per head (N, 3, H); written out here, not by fuse_qkv."""
    sd = canonical(12, 3, 1, 4, False)
    fused = layouts.to_layout(sd, "hf-falcon", num_heads=3)["query_key_value.weight"]
    assert np.array_equal(fused, np.concatenate([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]))
    sd = canonical(12, 3, 3, 4, False)
    fused = layouts.to_layout(sd, "hf-falcon", num_heads=3)["query_key_value.weight"]
    rows = [sd[f"{p}_proj.weight"][h * 4:(h + 1) * 4] for h in range(3) for p in "qkv"]
    assert np.array_equal(fused, np.concatenate(rows))


def _hf_attention(name, E, N, K, H, bias):
    """A tiny transformers attention module of the family, float64, and how to call its projections."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    if name == "phi3":
        cfg = tr.Phi3Config(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                            num_hidden_layers=1, pad_token_id=0)
        module = tr.models.phi3.modeling_phi3.Phi3Attention(cfg, 0)
    elif name == "neox":
        cfg = tr.GPTNeoXConfig(hidden_size=E, num_attention_heads=N, num_hidden_layers=1, attention_bias=bias)
        module = tr.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention(cfg, 0)
    else:
        cfg = tr.FalconConfig(hidden_size=E, num_attention_heads=N, num_kv_heads=K, num_hidden_layers=1, bias=bias,
                              new_decoder_architecture=name == "falcon-new", multi_query=name == "falcon-mq")
        module = tr.models.falcon.modeling_falcon.FalconAttention(cfg, 0)
    cfg._attn_implementation = "eager"
    return module.double()


def _module_qkv(name, module, x, N, K, H, monkeypatch):
    """q (B, T, N, H), k and v (B, T, K, H) as the module's own code splits its fused projection."""
    import torch

    if name.startswith("falcon"):
        q, k, v = module._split_heads(module.query_key_value(x))
        if name == "falcon-new":  # _split_heads broadcasts each group's k/v to its query heads: one per group
            k, v = k[:, :, ::N // K], v[:, :, ::N // K]
        return [a.detach().numpy() for a in (q, k, v)]
    seen = {}
    mod = __import__(type(module).__module__, fromlist=["_"])

    def rotary(q, k, cos, sin, *a, **kw):  # records q and k where RoPE would take them (B, n, T, H)
        seen["q"], seen["k"] = q, k
        return q, k

    def attention(m, q, k, v, *a, **kw):  # records v, (B, K, T, H)
        seen["v"] = v
        return torch.zeros(B, T, N, H, dtype=q.dtype), None

    monkeypatch.setattr(mod, "apply_rotary_pos_emb", rotary)
    monkeypatch.setattr(mod, "eager_attention_forward", attention)
    ones, zeros = torch.ones(B, T, H, dtype=torch.float64), torch.zeros(B, T, H, dtype=torch.float64)
    module(x, attention_mask=None, position_embeddings=(ones, zeros))
    return [seen[s].transpose(1, 2).detach().numpy() for s in "qkv"]


@pytest.mark.parametrize("name", LAYERS)
def test_the_split_is_the_one_transformers_does(name, monkeypatch):
    import torch

    layout, E, N, K, H, bias = LAYERS[name]
    sd = canonical(E, N, K, H, bias)
    module = _hf_attention(name, E, N, K, H, bias)
    tensors = {k: torch.from_numpy(v) for k, v in layouts.to_layout(sd, layout, num_heads=N).items()}
    module.load_state_dict(tensors, strict=True)  # every tensor of the module, and only those
    x = np.random.default_rng(2).standard_normal((B, T, E))
    got = _module_qkv(name, module, torch.from_numpy(x), N, K, H, monkeypatch)
    for p, heads, arr in zip("qkv", (N, K, K), got):
        ours = x @ sd[f"{p}_proj.weight"].T + (sd[f"{p}_proj.bias"] if bias else 0)
        np.testing.assert_allclose(arr, ours.reshape(B, T, heads, H), rtol=1e-12, atol=1e-12, err_msg=p)
    # the other fusion's rows, loaded instead, give the module other q/k/v: the comparison sees a wrong split
    # (with K = 1 the two fusions are one: Falcon's multi_query is the grouped view with one group)
    other = "grouped" if layout == "hf-phi3" else "rows"
    fused = layouts.LAYOUT_TABLES[layout].fused.key
    swapped = {k: layouts.fuse_qkv([sd[f"{p}_proj.{k.rsplit('.', 1)[1]}"] for p in "qkv"], other, (N, K, H), np.concatenate)
               if k.startswith(fused.rsplit(".", 1)[0]) else v.numpy() for k, v in tensors.items()}
    if K == 1:
        assert all(np.array_equal(swapped[k], tensors[k].numpy()) for k in tensors)
        return
    module.load_state_dict({k: torch.from_numpy(v) for k, v in swapped.items()})
    wrong = _module_qkv(name, module, torch.from_numpy(x), N, K, H, monkeypatch)
    ours = (x @ sd["q_proj.weight"].T + (sd["q_proj.bias"] if bias else 0)).reshape(B, T, N, H)
    assert not np.allclose(wrong[0], ours, rtol=1e-6, atol=1e-6)


def test_bad_shapes_and_missing_heads_are_named():
    sd = canonical(12, 3, 1, 8, False)
    t = layouts.to_layout(sd, "hf-phi3", prefix="p.")
    t["p.qkv_proj.weight"] = t["p.qkv_proj.weight"][:-1]  # 39 rows: not 24 + 2*K*H
    with pytest.raises(ValueError, match=re.escape("p.qkv_proj.weight has shape (39, 12), expected (N*H + 2*K*H, E) = (24 + 2*K*H, 12)")):
        layouts.from_layout(t, "hf-phi3", prefix="p.")
    sd = canonical(12, 3, 3, 4, True)
    t = layouts.to_layout(sd, "hf-gpt-neox", num_heads=3)
    t["query_key_value.bias"] = t["query_key_value.bias"][:30]
    with pytest.raises(ValueError, match=re.escape("query_key_value.bias has shape (30,), expected (36,) = (3E,)")):
        layouts.from_layout(t, "hf-gpt-neox", num_heads=3)
    t = layouts.to_layout(sd, "hf-falcon", num_heads=3)
    with pytest.raises(ValueError, match="query_key_value.weight interleaves q, k and v per key/value head .* needs num_heads="):
        layouts.from_layout(t, "hf-falcon")
    with pytest.raises(ValueError, match=re.escape("num_heads=5 does not divide N*H=12")):
        layouts.from_layout(t, "hf-falcon", num_heads=5)
    with pytest.raises(ValueError, match=re.escape("k_proj.weight has 4 rows, expected E=12: query_key_value.weight holds (N, 3, H)")):
        layouts.to_layout(canonical(12, 3, 1, 4, True), "hf-gpt-neox", num_heads=3)
    with pytest.raises(ValueError, match="the layout holds no biases"):
        layouts.to_layout(canonical(12, 3, 1, 8, True), "hf-phi3")


def test_a_fused_tensor_is_read_by_its_layout_and_refused_by_name_by_the_others():
    t = layouts.to_layout(canonical(12, 3, 1, 8, False), "hf-phi3", prefix="p.")
    account = layouts.account(t, "hf-phi3", "p.")
    assert account.read == ("p.o_proj.weight", "p.qkv_proj.weight") and not account.unread
    unread = layouts.account(t, "hf-llama", "p.").unread
    assert unread["p.qkv_proj.weight"].startswith("fused projections") and "hf-phi3" in unread["p.qkv_proj.weight"]
    with pytest.raises(KeyError, match=r"missing 'p.q_proj.weight'.* unread: 'p.qkv_proj.weight' \(fused projections"):
        layouts.from_layout(t, "hf-llama", prefix="p.")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_names_give_a_user_layer_the_fused_tensors_and_the_gradients_come_back(framework):
    """renamer (names= of a user layer) fuses in the framework's ops: the tensors equal to_layout's, and the
    gradient of <fused, g> with respect to the canonical tensors is g split back (fusing's transpose)."""
    for name in ("phi3", "falcon-new"):
        layout, E, N, K, H, bias = LAYERS[name]
        sd = canonical(E, N, K, H, bias)
        want = layouts.to_layout(sd, layout, num_heads=N)
        g = {k: np.random.default_rng(3).standard_normal(v.shape) for k, v in want.items()}
        rename = renamer(layout, framework, num_heads=N)
        if framework == "torch":
            import torch

            params = {k: torch.tensor(v, requires_grad=True) for k, v in sd.items()}
            out = rename(params)
            sum(torch.sum(out[k] * torch.from_numpy(g[k])) for k in out).backward()
            grads = {k: p.grad.numpy() for k, p in params.items()}
            out = {k: v.detach().numpy() for k, v in out.items()}
        else:
            import jax
            import jax.numpy as jnp

            with jax.enable_x64(True):
                params = {k: jnp.asarray(v) for k, v in sd.items()}
                out = {k: np.asarray(v) for k, v in rename(params).items()}
                grads = jax.grad(lambda p: sum(jnp.sum(v * g[k]) for k, v in rename(p).items()))(params)
                grads = {k: np.asarray(v) for k, v in grads.items()}
        assert sorted(out) == sorted(want) and all(np.array_equal(out[k], want[k]) for k in want)
        expected = layouts.from_layout(g, layout, num_heads=N)
        assert all(np.array_equal(grads[k], expected[k]) for k in sd), name
