import sys, time, torch, collections
from pathlib import Path
from moeinf import MoE, OffloadConfig
from moeinf.bench.quant import speed_inputs
from moeinf.runtime import mla_decode
from transformers import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave
torch.set_num_threads(1)
M = Path("/work/bench-data/e2e-zoo-full-2048x768")
cfg = OffloadConfig(offload_dir=str(M.with_name(M.name + ".moeinf-int4")), device_cache="100%", prefetch="none")
ids = speed_inputs(M, 1)[0]
acc = collections.Counter(); calls = [0]
def decode(self, hidden_states, position_embeddings, attention_mask, cache, kwargs):
    T = [time.perf_counter_ns()]
    def mark(name):
        now = time.perf_counter_ns(); acc[name] += now - T[0]; T[0] = now
    calls[0] += 1
    attn = self.inner
    batch = hidden_states.shape[0]
    q = attn.q_proj(hidden_states); mark("q_proj")
    q = q.view(batch, self.heads, 1, self.nope + self.rope)
    q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1); mark("split q")
    latent = attn.kv_a_proj_with_mqa(hidden_states); mark("kv_a_proj")
    kv_nope, k_rot = torch.split(latent, [attn.kv_lora_rank, self.rope], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope).view(batch, 1, 1, attn.kv_lora_rank); mark("kv norm")
    k_rot = k_rot.view(batch, 1, 1, self.rope)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin); mark("rotate")
    kv_nope, k_rot = cache.update(kv_nope, k_rot, attn.layer_idx, kwargs=kwargs); mark("cache.update")
    latents = kv_nope[:, 0].float()
    q_latent = torch.bmm(q_nope[:, :, 0].float().transpose(0, 1), self.w_uk).transpose(0, 1); mark("q_latent")
    scores = torch.baddbmm(torch.bmm(q_rot[:, :, 0].float(), k_rot[:, 0].float().transpose(1, 2)),
                           q_latent, latents.transpose(1, 2)); mark("scores")
    scores *= attn.scaling
    if attention_mask is not None:
        mask = attention_mask[:, 0, -1:, -scores.shape[-1]:]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    mark("mask")
    out_latent = torch.bmm(scores.softmax(dim=-1), latents)
    out = torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1); mark("softmax+out")
    r = attn.o_proj(out.to(hidden_states.dtype).reshape(batch, 1, self.heads * self.v_dim)); mark("o_proj")
    return r
mla_decode.AbsorbedMLADecode.decode = decode
with MoE(M, cfg) as moe, torch.inference_mode():
    model = moe.model
    cache = DynamicCache(config=model.config)
    out = model(ids, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
    for _ in range(3): out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
    acc.clear(); calls[0] = 0
    for _ in range(30): out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
    print("mask type", None)
for k, v in acc.items(): print(f"  {k:14s} {v/calls[0]/1e3:7.1f} us/call")
print("total us/call", sum(acc.values())/calls[0]/1e3)
