"""Engine integrations: vLLM's KV connector (``kvtier.integrations.vllm``) and SGLang's HiCache
storage backend (``kvtier.integrations.sglang``). Neither imports its engine at module level."""
