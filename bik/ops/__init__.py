"""Public ops, a module each (bik's own namespace re-exports them): validate inputs, then
dispatch to the selected backend (see bik.backends). What they share is in ``_dispatch``.

Every op is also a ``torch.library`` custom op (``torch.ops.bik.<name>``) with a fake kernel
and a registered autograd formula. ``_dispatch.run`` picks the path:
  * eager inference (no input needs a graph): the kernel is called directly, without the
    dispatcher's per-call cost, which dominates small decode-time calls;
  * a graph to record, ``torch.compile`` tracing, a dispatch mode (FakeTensorMode, make_fx),
    a ``torch.vmap`` / ``torch.func`` transform, meta tensors or tensor subclasses: the
    custom op, so autograd, Dynamo and fake-tensor
    propagation see one opaque op.
Both paths run the same kernel on the same inputs, so compiled and eager graphs give the
same bits.
"""
