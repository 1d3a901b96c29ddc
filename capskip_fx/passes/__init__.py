"""Graph passes; ``pipeline.py`` runs them in order (its docstring lists the steps).

joint graph (AOTAutograd, before partitioning), ``pipeline.joint``:
  find_head.py       -- locate the logits output, its tangent and the head input h (the head forms:
                        heads/, one registry entry each)
  in_graph_loss.py   -- a loss computed inside the model from the logits
  row_index.py       -- the backward's reads of arange(N) get their own arange (x[arange(N), j])
  insert_select.py   -- prove the forward's batch layout (placement/: refuses graphs whose forward mixes
                        examples, BatchNorm in train mode, ...), insert ``capskip::select`` and mask every
                        batch-shaped tangent (exact semantics)
backward graph (Inductor ``inner_compile``), ``pipeline.backward``:
  selected_rows.py   -- replace the selection node by an input; classify and check every gathered input
  gather_in_graph.py -- a proven backward graph (an in-graph loss's, or with gather="graph" the selected one) also compiled gathering its kept rows itself
A pass that will not rewrite a graph raises ``records.Refused(detail, kind)``; the pipeline returns its
typed ``Refusal``.  The batch symbol and size helpers are in ``symbolic.py``.
"""
