"""Graph passes, in data-path order.

joint graph (AOTAutograd, before partitioning):
  find_head.py     -- locate the logits output, its tangent and the head input h
  row_index.py     -- the backward's reads of arange(N) get their own arange (x[arange(N), j])
  insert_select.py -- prove the forward's batch layout (layout.py: refuses graphs whose forward mixes
                      examples, BatchNorm in train mode, ...), insert ``capskip::select`` and mask every
                      batch-shaped tangent (exact semantics)
backward graph (Inductor ``inner_compile``):
  selected_rows.py -- cut at the selection node and run the backward on the kept rows only
  gather_in_graph.py -- (gather="graph") take the saved activations at N rows and gather / scatter in the graph
A pass that will not rewrite a graph raises ``records.Refused``; the batch symbol and size helpers are in
``symbolic.py``.
"""
