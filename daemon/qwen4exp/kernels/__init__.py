"""Triton kernels (CUDA and ROCm), one module per part of the model they serve.

Naming: a module is named for what it computes (row_products, hyper, rope, router, conv, delta_rule, gated_norm,
gate_product, qsa_attention, qsa_select, moe); its public functions take and return torch tensors and check their
shapes; whether a kernel runs at all is decided once, by guard.serves, when the model's ops backend is chosen
(engine/model/backend.py). Each kernel has a torch form in engine/model that it is tested against bit for bit (or to
its documented rounding) under Triton's CPU interpreter; benches live in bench/, not here.
"""
