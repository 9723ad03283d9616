"""The runtime engine behind the callbacks: micro-batching, batch structure, the log buffer, replay state, optimizer
offload and the block transforms (checkpointing, compile) that apply a plan. Imports only ``autotune._device``."""
