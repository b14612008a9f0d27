"""A pure-torch stand-in for the few ``sgl_kernel`` helpers that SGLang 0.5.21's CPU path imports.

CPU and test support only: on this directory's path ONLY when :func:`trainer.rollout.sglang_cpu.activate`
runs (SGLang on CPU, no compiled ``sgl_kernel``). On GPU the real ``sglang-kernel`` wheel is used and this
directory is never on ``sys.path``.

No ``torch.ops.sgl_kernel`` op is registered, so SGLang sees no Intel AMX kernels
(``cpu_has_amx_support()`` reads ``torch._C._cpu._is_amx_tile_supported()`` AND the op table) and runs
every layer's plain torch forward, fp32 included. The speculative-decoding helpers are not needed by a
rollout engine and raise NotImplementedError if ever called.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+coxswain-cpu-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                  pool_len=None):
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + end[i] - start[i]]``
    with ``o_i = sum_{j<i} (end[j] - start[j])``: the Triton kernel ``assign_req_to_token_pool``
    (mem_cache/allocation.py ~654), called on every prefill and decode step."""
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    off = 0
    for r, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(*args, **kwargs):
    raise NotImplementedError("copy_all_layer_kv_cache_cpu (KV-cache move on CPU) is not provided by Coxswain's "
                              "sgl_kernel stand-in; it is only used by the hierarchical / host KV cache")


def _not_provided(name):
    def f(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not provided by Coxswain's CPU stand-in "
                                  f"(speculative decoding is not used by the rollout engine)")
    f.__name__ = name
    return f


# Every other ``*_cpu`` name sglang 0.5.21 imports from sgl_kernel (found by scanning its sources).
for _name in ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "build_draft_decode_metadata_cpu",
              "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
              "rotate_input_ids_cpu", "verify_tree_greedy_cpu"):
    globals()[_name] = _not_provided(_name)
del _name
