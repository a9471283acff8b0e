"""Stage 2, analysis: what each node costs and computes — FLOPs (``flops``), shapes (``shape_prop``), bytes saved
for backward (``saved_bytes``), layer kind and channels (``channels``) — the layers ranked (``rank``), and the
``networkx`` view (``graph_view``)."""
