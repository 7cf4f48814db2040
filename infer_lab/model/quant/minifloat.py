"""Small floating-point formats as codes: FP8 E4M3 and E5M2, FP4 E2M1, and the E8M0 scale.

A minifloat with ``e`` exponent bits, ``m`` mantissa bits and bias ``b`` stores
``(-1)^s * 2^(E - b) * (1 + M / 2^m)`` for ``E > 0`` and ``(-1)^s * 2^(1 - b) * M / 2^m``
(subnormals) for ``E = 0``. What differs between formats is which codes are special: E5M2 keeps
IEEE's infinities and NaNs in its top exponent; E4M3 "fn" (finite, the OCP FP8 spec's E4M3) gives
its top exponent to numbers and keeps only ``S.1111.111`` for NaN, so it reaches 448 instead of
240; E2M1 (FP4) has no special codes at all and tops out at 6.

Encoding rounds to nearest, ties to even (the mantissa's last bit 0), and *saturates*: a value
beyond the largest finite one becomes that value (the OCP spec's saturating conversion, what
quantizers use: an overflow to NaN or inf would poison a matmul). NaN and inf inputs are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer_lab.model.quant import FormatError


@dataclass(frozen=True)
class Minifloat:
    """A sign-exponent-mantissa format of at most 8 bits, stored one code per uint8."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    ieee_specials: bool  # top exponent is inf/NaN (E5M2); else only all-ones is NaN (E4M3)
    has_nan: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal number (and of every subnormal's step)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """The exponent of the largest finite number (the MX spec's ``emax_elem``)."""
        return int(torch.tensor(self.max_finite).frexp()[1]) - 1

    def encode(self, x: torch.Tensor, name: str = "tensor", signed_zero: bool = True
               ) -> torch.Tensor:
        """Codes (uint8) of ``x``: round to nearest even, saturate at ``max_finite``.

        ``signed_zero=False`` stores a value that rounds to zero as +0 (ggml's FP4 does).
        """
        x = x.detach().double()
        if not torch.isfinite(x).all():
            bad = "NaN" if torch.isnan(x).any() else "inf"
            raise FormatError(f"{name}: {bad} values cannot be encoded in {self.name}")
        sign = torch.signbit(x)
        a = x.abs().clamp(max=self.max_finite)
        exp = (torch.frexp(a)[1] - 1).clamp(min=self.emin)  # floor(log2 a), subnormals at emin
        quantum = torch.ldexp(torch.ones_like(a), exp - self.man_bits)
        r = (torch.round(a / quantum) * quantum).clamp(max=self.max_finite)  # ties to even
        e2 = torch.frexp(r)[1] - 1
        normal = r >= 2.0 ** self.emin
        exp_field = torch.where(normal, e2 + self.bias, torch.zeros_like(e2))
        one = torch.ones_like(r)
        man = torch.where(normal, r / torch.ldexp(one, e2 - self.man_bits) - 2**self.man_bits,
                          r / 2.0 ** (self.emin - self.man_bits))
        if not signed_zero:
            sign = sign & (r > 0)
        code = (sign.long() << (self.exp_bits + self.man_bits)) | (exp_field.long()
                                                                   << self.man_bits)
        return (code | man.long()).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of ``codes`` (NaN and inf codes decode to NaN and inf)."""
        c = codes.long()
        man = (c & (2**self.man_bits - 1)).double()
        exp = (c >> self.man_bits) & (2**self.exp_bits - 1)
        sign = torch.where(((c >> (self.exp_bits + self.man_bits)) & 1) == 1, -1.0, 1.0)
        frac = torch.where(exp > 0, 1.0 + man / 2**self.man_bits, man / 2**self.man_bits)
        value = sign.double() * torch.ldexp(frac, exp.clamp(min=1) - self.bias)
        top = exp == 2**self.exp_bits - 1
        if self.ieee_specials:
            value = torch.where(top & (man == 0), sign.double() * float("inf"), value)
            value = torch.where(top & (man > 0), float("nan"), value)
        elif self.has_nan:
            value = torch.where(top & (man == 2**self.man_bits - 1), float("nan"), value)
        return value.float()

    def round(self, x: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """``x`` rounded to the nearest value of this format (saturating), as float32."""
        return self.decode(self.encode(x, name))

    def values(self) -> torch.Tensor:
        """Every finite non-negative value, ascending (the format's grid)."""
        v = self.decode(torch.arange(2 ** (self.bits - 1), dtype=torch.uint8))
        return v[torch.isfinite(v)]


E4M3 = Minifloat("fp8_e4m3", 4, 3, 7, 448.0, ieee_specials=False,
                 torch_dtype=torch.float8_e4m3fn)
E5M2 = Minifloat("fp8_e5m2", 5, 2, 15, 57344.0, ieee_specials=True, torch_dtype=torch.float8_e5m2)
E2M1 = Minifloat("fp4_e2m1", 2, 1, 1, 6.0, ieee_specials=False, has_nan=False)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}


def e8m0_decode(codes: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """The MX block scale: code ``c`` is ``2^(c - 127)``; ``0xFF`` is NaN and is refused."""
    c = codes.long()
    if (c == 255).any():
        raise FormatError(f"{name}: E8M0 code 0xFF (NaN) in a block scale")
    return torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - 127)


def e8m0_encode(exponent: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """Codes of the scales ``2^exponent``; an exponent outside -127..127 cannot be stored."""
    e = exponent.long()
    if ((e < -127) | (e > 127)).any():
        lo, hi = int(e.min()), int(e.max())
        raise FormatError(f"{name}: MX block exponent out of E8M0's range -127..127 "
                          f"(got {lo}..{hi})")
    return (e + 127).to(torch.uint8)
