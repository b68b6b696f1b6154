"""The proof that every rule runs one kernel: the rewritten graphs and the kernel fingerprint (`fingerprint`), the
fingerprints kept on disk (`fingerprint_store`), and what `fxbudget inspect` prints (`graph_summary`).

May import: `compiler`, `cache`, `passes`, `kernel`, `rules`, `models`, `checks` (and the package version).
"""
