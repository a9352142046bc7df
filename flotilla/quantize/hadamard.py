"""Orthogonal matrices for `quantize --rotate`: randomized Hadamard where the size allows, else random.

A Hadamard matrix H (entries ±1, H Hᵀ = n I) of order n is built as a Kronecker product of a
Sylvester matrix of order 2^k with one Paley matrix (or none):

    Paley I   order q + 1      for a prime q ≡ 3 (mod 4)   (12, 20, 24, 32, 44, 48, 60, 68, 72, ...)
    Paley II  order 2 (q + 1)  for a prime q ≡ 1 (mod 4)   (12, 28, 36, 60, 76, 108, ...)

so 576 (SmolLM2's hidden size) = 72 (Paley I, q = 71) x 8, 960 = 60 x 16, 64 = 2^6. The rotation
is H / sqrt(n) with a random sign on each row, D H / sqrt(n) (QuaRot's randomized Hadamard).
Orders with no such factorization get a random orthogonal matrix: the Q of a seeded Gaussian's QR.
"""
from __future__ import annotations

import torch

def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def sylvester(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order n, a power of two."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i), χ the quadratic character mod the prime q (0 at 0)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def paley1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime q ≡ 3 (mod 4): I + S, S = [[0, 1ᵀ], [-1, Q]] skew-symmetric."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
    return s + torch.eye(q + 1, dtype=torch.float64)


def paley2(q: int) -> torch.Tensor:
    """Order 2 (q + 1) for a prime q ≡ 1 (mod 4), from the symmetric conference matrix
    C = [[0, 1ᵀ], [1, Q]]: each 0 of C becomes [[1, -1], [-1, -1]], each ±1 becomes ±[[1, 1], [1, -1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron(torch.eye(q + 1, dtype=torch.float64), zero)


def _core(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m from Paley I or II (or the 1x1 one), or None."""
    if m in (1, 2):
        return sylvester(m)
    if m % 4:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return paley1(m - 1)
    if _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return paley2(m // 2 - 1)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order n (fp64, entries ±1), or None when n = 2^k · m has no Paley core m."""
    power = 1
    while n % power == 0:
        core = _core(n // power)
        if core is not None:
            return torch.kron(core, sylvester(power))
        power *= 2
    return None


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal matrix (fp64): Q of a Gaussian's QR, columns signed by R's diagonal."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotation(n: int, kind: str, seed: int) -> tuple[torch.Tensor, str]:
    """An n x n orthogonal matrix (fp64) and what it is ("hadamard-576", "random-576"): `kind`
    hadamard gives a randomized Hadamard where n allows one, else (like `random`) a random orthogonal."""
    gen = torch.Generator().manual_seed(seed)
    h = hadamard(n) if kind == "hadamard" else None
    if h is None:
        return random_orthogonal(n, gen), f"random-{n}"
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    return signs[:, None] * h / n ** 0.5, f"hadamard-{n}"
