"""`torch.nn.attention.varlen.varlen_attn`'s parameter list in each torch release since it exists, copied verbatim
from the released wheels' `torch/nn/attention/varlen.py` (2.12.1, 2.13.0 and 2.14.1 are the same). The tests build
a CPU kernel with exactly these parameters, so a keyword one release does not take fails as it would on it."""

SIGNATURES = {
    "2.10.0": (
        "query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, "
        "max_q: int, max_k: int, is_causal: bool = False, return_aux: AuxRequest | None = None"
    ),
    "2.11.0": (
        "query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, "
        "max_q: int, max_k: int, *, return_aux: AuxRequest | None = None, scale: float | None = None, "
        "window_size: tuple[int, int] = (-1, -1)"
    ),
    "2.12.1": (
        "query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, "
        "cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux: AuxRequest | None = None, "
        "scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False, "
        "seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None, num_splits: int | None = None"
    ),
}
