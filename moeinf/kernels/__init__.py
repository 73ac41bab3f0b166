"""Tensor math that knows no model family and no residency: what the runtime and the model patches call.

- `moe.py`: one expert's exact math (`GatedKernel`, `DenseActDenseKernel`), tokens grouped by expert
  (`Dispatch`) and HF's combine (`ExpertOutputs`): router -> dispatch -> experts -> combine.
- `quant_experts.py`: the quantised experts' kernels; `quant_linear.py`: quantised dense linears.
- `gemv.py`: moeinf's one-row GEMV over the C++ kernels (int8/int4, threads, steps).
- `bf16_rows.py`: one-row bf16 products with `F.linear`'s bits; `norms.py`: fused RMSNorms.
"""
