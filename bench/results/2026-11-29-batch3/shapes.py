"""Does a row's result depend on the shape it is computed in? torch's products and attention on this CPU."""
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    for h, o in ((128, 128), (2048, 1536)):
        w = torch.randn(o, h).to(dt)
        x = torch.randn(64, h).to(dt)
        full = F.linear(x, w)
        same = sum(int(torch.equal(F.linear(x[i:i + 1], w)[0], full[i])) for i in range(64))
        same8 = sum(int(torch.equal(F.linear(x[:8], w)[i], full[i])) for i in range(8))
        print(f"{dt} linear {h}x{o}: a row alone == the row in a 64-row product for {same}/64; "
              f"in an 8-row product {same8}/8")
    q = torch.randn(1, 4, 1, 32).to(dt)
    k = torch.randn(1, 4, 40, 32).to(dt)
    v = torch.randn(1, 4, 40, 32).to(dt)
    alone = F.scaled_dot_product_attention(q, k[:, :, 10:], v[:, :, 10:])
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    mask[..., 10:] = True
    padded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    print(f"{dt} sdpa over 30 keys alone vs left-padded to 40 (masked): equal {torch.equal(alone, padded)}, "
          f"max abs difference {(alone.float() - padded.float()).abs().max().item():.3g}")
