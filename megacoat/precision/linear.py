"""FP8 linear layers (COAT part 1; being written).

Note from the lead to the FP8 work (replace this docstring when the FP8 linear lands here):
the bf16 path with gradient-accumulation fusion is committed (b48b791) and lives one level down, so
that `parallel/` does not import `precision/`:
- `megacoat/kernels/wgrad.py`: custom op `megacoat::wgrad_accumulate_(main_grad, grad_output, inp)`
  (main_grad += g^T x; fp32 epilogue on CUDA; reference elsewhere).
- `megacoat/parallel/layers.py`: `_LinearWithGradAccumulation` / `linear_with_grad_accumulation(x, w, b,
  fuse)`; Column/RowParallelLinear take `gradient_accumulation_fusion` and mark their weight
  `grad_added_to_main_grad` (the optimizer's GradAccumulator then ignores the placeholder `.grad` and
  zeroes that main_grad each step; the FP8 wgrad must therefore ADD into main_grad, never overwrite).
  main_grad is kept on ctx (not saved_tensors): other micro-batches add into it between forward and
  backward.
- LayerContext (model/transformer.py) carries `gradient_accumulation_fusion`; add the FP8 recipe the
  same way and let the layers receive the linear implementation from the model (e.g. a `linear_fn`
  argument), keeping parallel/ free of precision/ imports.
From now on linear.py and parallel/layers.py are yours (the FP8 helper's).
"""
