"""Stage 1, capture: the model as a ``torch.fx.GraphModule`` (``trace``, ``training_flags``), or, where its own
code does not trace, region by region (``regions``) stitched into one planning graph (``stitch``), with the eager
code's FLOPs (``eager_flops``) and saved bytes (``eager_saved``) measured in a real step."""
