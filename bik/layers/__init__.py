"""Model- and engine-shaped compositions of bik's ops: mixture-of-experts routing and expert
MLPs (``moe``), rotary embeddings (``rotary``), attention over an engine's paged KV cache
(``paged_attention``). Each is built from the ops in ``bik.ops`` (and a backend's optional
accelerator, ``backends.base.ACCELERATORS``) in a stated order; integrations (``bik.hf``,
``bik.vllm``) call these, kernels know nothing of them."""
