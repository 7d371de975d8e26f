"""When the attention kernels do not run, in words: one phrase per check, in each check's order.

Kept apart from the kernels (``cpu_paged``, ``selector``), which import torch, so the tutorial
can list them in an app that loads no model (``--replay``, ``--connect``).
"""

ENV_SWITCH = "NANOVLLM_CPU_PAGED_ATTENTION"  # "0" turns the CPU paged kernel off (A/B runs, tests of the fallback)
FLASH_ATTN_PAGE_SIZE = 256

# On the CPU, one phrase per check of :func:`unsupported_reason` (after the device's), in its
# order: when the kernel does not run. The tutorial's paged-attention chapter lists these
# rather than restating them.
FALLBACK_CONDITIONS = (
    f"{ENV_SWITCH}=0",
    "a dtype other than float32 (bfloat16 or float16)",
    "--no-flash-attn (the math backend keeps the explicit score matrix)",
    "no C compiler with OpenMP (or a failed build)",
)


# When flash-attn's paged kernel does not run, one phrase per check of
# :func:`flash_attn_unsupported`, in its order (the tutorial lists these).
FLASH_ATTN_FALLBACK_CONDITIONS = (
    "no CUDA GPU",
    "float32 (it runs float16 and bfloat16)",
    "a GPU older than compute capability 8.0",
    "a head size not a multiple of 8 or above 256",
    f"blocks not a multiple of {FLASH_ATTN_PAGE_SIZE} tokens",
    "flash-attn not installed",
)
