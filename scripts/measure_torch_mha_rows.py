"""torch.nn.MultiheadAttention on a fully masked row, measured on every path: eval/train, grad/no_grad, need_weights, key_padding_mask/attn_mask.

Beyond mha-bench, which measures speed: this records what torch computes on each of those paths.

Run: .venv/bin/python scripts/measure_torch_mha_rows.py (its result is in docs/semantics.md)."""
import torch
torch.manual_seed(0)
E, N, B, T = 12, 3, 2, 5
m = torch.nn.MultiheadAttention(E, N, batch_first=True).eval()
with torch.no_grad():
    m.out_proj.bias.uniform_(0.5, 1.0); m.in_proj_bias.uniform_(-0.5, 0.5)
x = torch.randn(B, T, E)
kpm = torch.zeros(B, T, dtype=torch.bool); kpm[1, :] = True
attn = torch.zeros(T, T, dtype=torch.bool); attn[0, :] = True
def what(rows):
    if rows.isnan().all(): return "NaN"
    if torch.allclose(rows, m.out_proj.bias.expand_as(rows)): return "out_proj.bias (zero context)"
    if (rows == 0).all(): return "exact 0 (not even the bias)"
    return "finite, other"
for grad in (False, True):
    for mode in ("eval", "train"):
        getattr(m, mode)()
        with torch.set_grad_enabled(grad):
            for nw in (True, False):
                out, _ = m(x, x, x, key_padding_mask=kpm, need_weights=nw)
                out2, _ = m(x, x, x, attn_mask=attn, need_weights=nw)
                print(f"{mode:5s} grad={grad!s:5s} need_weights={nw!s:5s} key_padding_mask all-padded batch: {what(out[1].detach()):30s} attn_mask empty row: {what(out2[:,0].detach())}")
