// The schema of every fused_ops operator, in one place.  Kernels register
// against these names from cpu/*.cpp and cuda/*.cu with TORCH_LIBRARY_IMPL;
// fake (meta) implementations and autograd live in Python (fused_ops/ops.py).

#include <Python.h>
#include <torch/csrc/stable/library.h>

// A Python module with no functions: importing fused_ops._C loads this shared
// library, whose static initialisers register the ops with the dispatcher.
// Built against the Python limited API (Py_LIMITED_API, setup.py), so the one
// abi3 shared library loads into every CPython from 3.10 on; the ops register
// through the LibTorch stable ABI, so it also loads into several torch releases.
extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

STABLE_TORCH_LIBRARY(fused_ops, m) {
  m.def(
      "importance_sampling(Tensor samples, Tensor mix_weights, Tensor mix_mus, Tensor mix_stds, "
      "Tensor q_mu, Tensor q_std) -> (Tensor weighted_mean, Tensor ess, Tensor log_weights)");
  m.def(
      "importance_sampling_backward(Tensor? grad_weighted_mean, Tensor? grad_ess, "
      "Tensor? grad_log_weights, Tensor samples, Tensor mix_weights, Tensor mix_mus, "
      "Tensor mix_stds, Tensor q_mu, Tensor q_std, Tensor weighted_mean, Tensor log_weights) "
      "-> (Tensor grad_samples, Tensor grad_mix_weights, Tensor grad_mix_mus, "
      "Tensor grad_mix_stds, Tensor grad_q_mu, Tensor grad_q_std)");
  m.def(
      "flow_euler(Tensor x0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor w3, Tensor b3, "
      "int num_steps) -> Tensor");
  m.def(
      "vae_elbo(Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, "
      "Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, "
      "Tensor b_dec2) -> (Tensor elbo, Tensor recon, Tensor kl)");
  // The discrete adjoint of flow_euler (its backward; csrc/flow_euler_backward.h).
  m.def(
      "flow_euler_backward(Tensor grad_x, Tensor x0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, "
      "Tensor w3, Tensor b3, int num_steps) -> (Tensor grad_x0, Tensor grad_w1, Tensor grad_b1, "
      "Tensor grad_w2, Tensor grad_b2, Tensor grad_w3, Tensor grad_b3)");
  m.def(
      "vae_elbo_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl, Tensor x, "
      "Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, Tensor w_logvar, "
      "Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, Tensor b_dec2) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // CPU only: vae_elbo that also returns the activations its backward needs
  // (csrc/vae_elbo.h, VaeSavedLayout), and that backward, which reads them
  // instead of recomputing the forward; grad_x is computed only when asked
  // for (an empty tensor otherwise).  fused_ops.vae_elbo routes CPU calls
  // that need gradients here.
  m.def(
      "vae_elbo_train(Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, "
      "Tensor b_mu, Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, "
      "Tensor w_dec2, Tensor b_dec2) -> (Tensor elbo, Tensor recon, Tensor kl, Tensor saved)");
  m.def(
      "vae_elbo_train_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl, "
      "Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, "
      "Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, "
      "Tensor b_dec2, Tensor saved, bool compute_grad_x) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}
