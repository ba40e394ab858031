"""Every use of torch's private APIs, in one place: when torch changes, only this package does.

A private API is a module whose path has a part starting with ``_`` (``torch._C``,
``torch._inductor``, ``torch.utils._pytree``) or a ``_``-prefixed attribute of a torch object
(``Module._global_forward_pre_hooks``, ``Tensor._version``, ``OpOverload._schema``).  The rest of
the adapter calls the named functions here, whose docstrings say which torch releases they are
checked on and what they do where a release lacks the API (a version gate, or None).  Objects
handed out here (an inductor lowering, a dynamo frame strategy) are used through their public
members only.  ``tests/test_layout.py`` fails on a private torch use anywhere else.

The modules: ``dispatch`` (the dispatch mode, pytrees, dispatch keys, op schemas), ``tensors``
(a tensor's version, base, functorch and DTensor wrappers, layouts), ``autograd`` (the engine
and module hooks), ``dynamo`` (frame evaluation, the tracing context), ``inductor`` (the compile
pipeline, its caches and lowering), ``distributed`` (c10d objects, DTensor placements).
"""
