#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""terrace's CPU Adam/AdamW against torch.optim.Adam / AdamW, 20 steps on the same data, through
the C ABI (include/terrace/optimizer.h) with ctypes; and its Lion against Lion written in torch
(torch.optim has none).

Run with Debian's /usr/bin/python3 (python3-torch). TERRACE_LIBRARY is libterrace.so. Exits 77
(ctest: skipped), saying why, when torch or the library is missing."""
import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_test_support import torch_and_library  # noqa: E402

torch, LIB_PATH = torch_and_library()

lib = ctypes.CDLL(LIB_PATH)
F32, BF16, F16 = 0, 1, 2
ADAM, ADAMW, LION = 0, 1, 2
EINVAL = -1
P = ctypes.c_void_p

lib.terrace_adam_create.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                                    ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_int,
                                    ctypes.POINTER(P)]
lib.terrace_adam_destroy.argtypes = [P]
lib.terrace_adam_destroy.restype = None
lib.terrace_adam_step.argtypes = [P, ctypes.c_size_t] + [ctypes.POINTER(P)] * 5 + [
    ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float,
    ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
lib.terrace_adam_grad_norm.argtypes = [P, ctypes.c_size_t, ctypes.POINTER(P),
                                       ctypes.POINTER(ctypes.c_size_t), ctypes.c_int,
                                       ctypes.c_float, ctypes.POINTER(ctypes.c_double),
                                       ctypes.POINTER(ctypes.c_int)]
lib.terrace_adam_get_step.argtypes = [P, ctypes.POINTER(ctypes.c_int64)]
lib.terrace_adam_set_step.argtypes = [P, ctypes.c_int64]
lib.terrace_adam_isa.argtypes = [P]
lib.terrace_adam_isa.restype = ctypes.c_char_p
lib.terrace_last_error.restype = ctypes.c_char_p

DTYPE = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}


def pointers(tensors):
    return (P * len(tensors))(*[t.data_ptr() for t in tensors])


class Optimizer:
    def __init__(self, mode, lr, betas, eps, weight_decay, state=F32, threads=2):
        self.handle = P()
        rc = lib.terrace_adam_create(mode, lr, betas[0], betas[1], eps, weight_decay, state,
                                     threads, ctypes.byref(self.handle))
        if rc != 0:
            raise ValueError(lib.terrace_last_error().decode())

    def __del__(self):
        lib.terrace_adam_destroy(self.handle)

    def step(self, params, ms, vs, grads, copies=None, grad_dtype=F32, copy_dtype=BF16,
             grad_scale=1.0, clip_coef=1.0, check_finite=False):
        sizes = (ctypes.c_size_t * len(params))(*[p.numel() for p in params])
        stepped = ctypes.c_int(-1)
        rc = lib.terrace_adam_step(self.handle, len(params), pointers(params), pointers(ms),
                                   pointers(vs) if vs is not None else None, pointers(grads),
                                   pointers(copies) if copies else None, sizes, grad_dtype,
                                   copy_dtype, grad_scale, clip_coef, int(check_finite),
                                   ctypes.byref(stepped))
        return rc, stepped.value

    def steps(self):
        s = ctypes.c_int64()
        assert lib.terrace_adam_get_step(self.handle, ctypes.byref(s)) == 0
        return s.value


class AgainstTorch(unittest.TestCase):
    STEPS = 20
    SIZES = (10007, 3, 4096)

    def compare(self, torch_cls, mode, grad_dtype=F32, grad_scale=1.0, copy_dtype=None):
        torch.manual_seed(0)
        lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01
        ours = [torch.randn(n) for n in self.SIZES]
        theirs = [torch.nn.Parameter(p.clone()) for p in ours]
        ms = [torch.zeros(n) for n in self.SIZES]
        vs = [torch.zeros(n) for n in self.SIZES]
        copies = [torch.empty(n, dtype=DTYPE[copy_dtype]) for n in self.SIZES] if copy_dtype is not None else None
        reference = torch_cls(theirs, lr=lr, betas=betas, eps=eps, weight_decay=wd)
        opt = Optimizer(mode, lr, betas, eps, wd)
        for _ in range(self.STEPS):
            # Gradients as the GPU would send them: in grad_dtype, multiplied by the loss scale.
            grads = [(torch.randn(n) * grad_scale).to(DTYPE[grad_dtype]) for n in self.SIZES]
            for p, g in zip(theirs, grads):
                p.grad = g.float() / grad_scale
            reference.step()
            rc, stepped = opt.step(ours, ms, vs, grads, copies, grad_dtype,
                                   copy_dtype if copy_dtype is not None else BF16, grad_scale,
                                   check_finite=True)
            self.assertEqual(rc, 0, lib.terrace_last_error().decode())
            self.assertEqual(stepped, 1)
        self.assertEqual(opt.steps(), self.STEPS)
        for i, p in enumerate(theirs):
            state = reference.state[p]
            self.assertEqual(int(state["step"]), self.STEPS)
            # Float rounding only: torch rounds some products twice where the kernel fuses them;
            # the absolute terms are a few float ulps of the typical magnitude (m ~ 0.3, v ~ 0.02)
            # for elements whose moment cancelled to near zero.
            torch.testing.assert_close(ours[i], p.detach(), rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(ms[i], state["exp_avg"], rtol=1e-5, atol=2e-7)
            torch.testing.assert_close(vs[i], state["exp_avg_sq"], rtol=1e-5, atol=1e-9)
            if copies:
                # The copy is our own fp32 param rounded by torch's conversion: bit for bit.
                self.assertTrue(torch.equal(copies[i], ours[i].to(DTYPE[copy_dtype])))

    def test_adamw_f32(self):
        self.compare(torch.optim.AdamW, ADAMW)

    def test_adam_f32(self):
        self.compare(torch.optim.Adam, ADAM)

    def test_adamw_bf16_grads_loss_scaled_with_bf16_copy(self):
        self.compare(torch.optim.AdamW, ADAMW, grad_dtype=BF16, grad_scale=1024.0, copy_dtype=BF16)

    def test_adam_f16_grads_loss_scaled_with_f16_copy(self):
        self.compare(torch.optim.Adam, ADAM, grad_dtype=F16, grad_scale=256.0, copy_dtype=F16)

    def test_lion_against_lion_in_torch(self):
        # Lion as its authors' reference code writes it, in float32 torch ops; terrace gets no
        # exp_avg_sq at all (NULL).
        torch.manual_seed(1)
        lr, betas, wd, scale = 1e-4, (0.9, 0.99), 0.1, 1024.0
        ours = [torch.randn(n) for n in self.SIZES]
        theirs = [p.clone() for p in ours]
        ms = [torch.zeros(n) for n in self.SIZES]
        their_ms = [torch.zeros(n) for n in self.SIZES]
        copies = [torch.empty(n, dtype=torch.bfloat16) for n in self.SIZES]
        opt = Optimizer(LION, lr, betas, 1e-8, wd)
        for _ in range(self.STEPS):
            grads = [(torch.randn(n) * scale).to(torch.bfloat16) for n in self.SIZES]
            for p, m, g in zip(theirs, their_ms, grads):
                grad = g.float() / scale
                p.mul_(1 - lr * wd)
                update = m.clone().mul_(betas[0]).add(grad, alpha=1 - betas[0]).sign_()
                p.add_(update, alpha=-lr)
                m.mul_(betas[1]).add_(grad, alpha=1 - betas[1])
            rc, stepped = opt.step(ours, ms, None, grads, copies, BF16, BF16, scale)
            self.assertEqual((rc, stepped), (0, 1), lib.terrace_last_error().decode())
        self.assertEqual(opt.steps(), self.STEPS)
        for i in range(len(self.SIZES)):
            # The sign is exact; only the decay and the moment round (and fuse) differently.
            torch.testing.assert_close(ours[i], theirs[i], rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(ms[i], their_ms[i], rtol=1e-5, atol=2e-7)
            self.assertTrue(torch.equal(copies[i], ours[i].to(torch.bfloat16)))

    def test_overflow_skips_the_step(self):
        p, m, v = torch.randn(1000), torch.zeros(1000), torch.zeros(1000)
        g = torch.randn(1000)
        g[999] = float("inf")
        before = (p.clone(), m.clone(), v.clone())
        opt = Optimizer(ADAMW, 1e-3, (0.9, 0.999), 1e-8, 0.0)
        rc, stepped = opt.step([p], [m], [v], [g], check_finite=True)
        self.assertEqual((rc, stepped, opt.steps()), (0, 0, 0))
        for a, b in zip((p, m, v), before):
            self.assertTrue(torch.equal(a, b))

    def test_grad_norm_matches_torch(self):
        grads = [torch.randn(n) * 512 for n in self.SIZES]
        opt = Optimizer(ADAMW, 1e-3, (0.9, 0.999), 1e-8, 0.0)
        sizes = (ctypes.c_size_t * len(grads))(*[g.numel() for g in grads])
        norm, finite = ctypes.c_double(), ctypes.c_int()
        rc = lib.terrace_adam_grad_norm(opt.handle, len(grads), pointers(grads), sizes, F32, 512.0,
                                        ctypes.byref(norm), ctypes.byref(finite))
        self.assertEqual(rc, 0)
        expected = torch.norm(torch.stack([torch.norm(g.double() / 512) for g in grads])).item()
        self.assertAlmostEqual(norm.value, expected, delta=1e-5 * expected)
        self.assertEqual(finite.value, 1)

    def test_bad_input_is_an_error_code_with_a_message(self):
        with self.assertRaisesRegex(ValueError, "lr must be > 0"):
            Optimizer(ADAMW, 0.0, (0.9, 0.999), 1e-8, 0.0)
        with self.assertRaisesRegex(ValueError, "beta2 must be in"):
            Optimizer(ADAMW, 1e-3, (0.9, 1.0), 1e-8, 0.0)
        opt = Optimizer(ADAMW, 1e-3, (0.9, 0.999), 1e-8, 0.0)
        buf = torch.zeros(101)
        misaligned = buf.view(torch.uint8)[1:397]  # a pointer 1 byte into a float buffer
        sizes = (ctypes.c_size_t * 1)(99)
        rc = lib.terrace_adam_step(opt.handle, 1, (P * 1)(misaligned.data_ptr()),
                                   pointers([buf]), pointers([buf]), pointers([buf]), None, sizes,
                                   F32, BF16, 1.0, 1.0, 0, None)
        self.assertEqual(rc, EINVAL)
        self.assertIn("param is not aligned", lib.terrace_last_error().decode())
        rc = lib.terrace_adam_step(opt.handle, 1, (P * 1)(None), pointers([buf]),
                                   pointers([buf]), pointers([buf]), None, sizes, F32, BF16,
                                   1.0, 1.0, 0, None)
        self.assertEqual(rc, EINVAL)
        self.assertIn("param is null", lib.terrace_last_error().decode())
        # Found in review: a negative count converted to size_t (-1 from a C caller) failed to size
        # a std::vector and came back as TERRACE_EINTERNAL, "a bug", instead of a bad argument.
        for count in (2**64 - 1, 2**63):
            rc = lib.terrace_adam_step(opt.handle, count, pointers([buf]), pointers([buf]),
                                       pointers([buf]), pointers([buf]), None, sizes, F32, BF16,
                                       1.0, 1.0, 0, None)
            self.assertEqual(rc, EINVAL, lib.terrace_last_error().decode())
            self.assertIn(f"count {count}", lib.terrace_last_error().decode())
            norm = ctypes.c_double()
            rc = lib.terrace_adam_grad_norm(opt.handle, count, pointers([buf]), sizes, F32, 1.0,
                                            ctypes.byref(norm), None)
            self.assertEqual(rc, EINVAL, lib.terrace_last_error().decode())
            self.assertIn(f"count {count}", lib.terrace_last_error().decode())
        self.assertEqual(opt.steps(), 0)


if __name__ == "__main__":
    torch.set_num_threads(2)
    probe = Optimizer(ADAMW, 1e-3, (0.9, 0.999), 1e-8, 0.0)
    print(f"torch {torch.__version__}; terrace kernels: {lib.terrace_adam_isa(probe.handle).decode()}")
    del probe
    unittest.main(verbosity=2)
