// \brief The schema of every fused_ops operator, in one place.  Kernels register
// against these names from cpu/<op>/*.cpp and cuda/<op>/*.cu with
// STABLE_TORCH_LIBRARY_IMPL; fake (meta) implementations and autograd live in
// Python (fused_ops/ops/_<op>.py).  The fakes apply the argument checks of
// the C++ call set-up (csrc/<op>.h) with the same messages
// (fused_ops/ops/_checks.py); they also run for a call with only some inputs
// on the meta device, which they refuse by name.

#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <cstring>
#include <string>

#include "common/dispatch.h"

// A Python module: importing fused_ops._C loads this shared
// library, whose static initialisers register the ops with the dispatcher.
// Built against the Python limited API (Py_LIMITED_API, setup.py), so the one
// abi3 shared library loads into every CPython from 3.10 on; the ops register
// through the LibTorch stable ABI, so it also loads into several torch releases.
//
// Its only functions are the kernel-path debug hook (common/dispatch.h),
// wrapped by fused_ops/_paths.py: list a table's paths, force one, ask which
// one the latest call took.
namespace {

using fused_ops::dispatch::TableInfo;

TableInfo* table_arg(PyObject* args, const char** name) {
  const char *op = nullptr, *device = nullptr;
  if (name ? !PyArg_ParseTuple(args, "ssz", &op, &device, name) : !PyArg_ParseTuple(args, "ss", &op, &device)) {
    return nullptr;
  }
  TableInfo* t = fused_ops::dispatch::find_table(op, device);
  if (!t) PyErr_Format(PyExc_KeyError, "fused_ops has no kernel-path table for %s on %s", op, device);
  return t;
}

PyObject* str_or_none(const char* s) {
  if (s) return PyUnicode_FromString(s);
  Py_INCREF(Py_None);
  return Py_None;
}

// _paths(op, device) -> [(name, when, why), ...] in the table's order.
PyObject* py_paths(PyObject*, PyObject* args) {
  TableInfo* t = table_arg(args, nullptr);
  if (!t) return nullptr;
  PyObject* list = PyList_New(0);
  for (size_t i = 0; list && i < t->names.size(); ++i) {
    PyObject* row = Py_BuildValue("(sss)", t->names[i], t->when[i], t->why[i]);
    if (!row || PyList_Append(list, row) != 0) Py_CLEAR(list);
    Py_XDECREF(row);
  }
  return list;
}

// _force_path(op, device, name or None): later calls take that path (None: the table's choice).
PyObject* py_force_path(PyObject*, PyObject* args) {
  const char* name = nullptr;
  TableInfo* t = table_arg(args, &name);
  if (!t) return nullptr;
  int index = -1;
  if (name) {
    for (size_t i = 0; i < t->names.size(); ++i) {
      if (std::strcmp(t->names[i], name) == 0) index = int(i);
    }
    if (index < 0) {
      std::string known;
      for (const char* n : t->names) known += std::string(known.empty() ? "" : ", ") + n;
      PyErr_Format(PyExc_ValueError, "%s (%s) has no kernel path '%s'; its paths: %s", t->op, t->device,
                   name, known.c_str());
      return nullptr;
    }
  }
  t->forced.store(index, std::memory_order_relaxed);
  Py_INCREF(Py_None);
  return Py_None;
}

// _last_path(op, device) -> the path the latest call took, or None before any call.
PyObject* py_last_path(PyObject*, PyObject* args) {
  TableInfo* t = table_arg(args, nullptr);
  if (!t) return nullptr;
  const int last = t->last.load(std::memory_order_relaxed);
  return str_or_none(last >= 0 ? t->names[last] : nullptr);
}

// _clear_last_paths(): every table's latest path back to none.
PyObject* py_clear_last_paths(PyObject*, PyObject*) {
  for (TableInfo* t : fused_ops::dispatch::registry()) t->last.store(-1, std::memory_order_relaxed);
  Py_INCREF(Py_None);
  return Py_None;
}

// _tables() -> [(op, device), ...]: every table this build registered.
PyObject* py_tables(PyObject*, PyObject*) {
  PyObject* list = PyList_New(0);
  for (const TableInfo* t : fused_ops::dispatch::registry()) {
    PyObject* row = Py_BuildValue("(ss)", t->op, t->device);
    if (!row || PyList_Append(list, row) != 0) Py_CLEAR(list);
    Py_XDECREF(row);
    if (!list) break;
  }
  return list;
}

PyMethodDef kMethods[] = {
    {"_paths", py_paths, METH_VARARGS, "(op, device) -> [(name, when, why)]"},
    {"_force_path", py_force_path, METH_VARARGS, "(op, device, name or None)"},
    {"_last_path", py_last_path, METH_VARARGS, "(op, device) -> name or None"},
    {"_tables", py_tables, METH_NOARGS, "() -> [(op, device)]"},
    {"_clear_last_paths", py_clear_last_paths, METH_NOARGS, "() -> None"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
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
  // likelihood: the reconstruction term (csrc/common/likelihood.h; 0 is BCE).
  m.def(
      "vae_elbo(Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, "
      "Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, "
      "Tensor b_dec2, int likelihood=0) -> (Tensor elbo, Tensor recon, Tensor kl)");
  // The discrete adjoint of flow_euler (its backward; csrc/flow_euler_backward.h).
  m.def(
      "flow_euler_backward(Tensor grad_x, Tensor x0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, "
      "Tensor w3, Tensor b3, int num_steps) -> (Tensor grad_x0, Tensor grad_w1, Tensor grad_b1, "
      "Tensor grad_w2, Tensor grad_b2, Tensor grad_w3, Tensor grad_b3)");
  m.def(
      "vae_elbo_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl, Tensor x, "
      "Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, Tensor w_logvar, "
      "Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, Tensor b_dec2, "
      "int likelihood=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
  // vae_elbo that also returns the activations its backward needs
  // (csrc/vae_elbo.h, VaeSavedLayout), and that backward, which reads them
  // instead of recomputing the forward; grad_x is computed only when asked
  // for (an empty tensor otherwise).  fused_ops.vae_elbo routes calls that
  // need gradients here: on the CPU all, on CUDA large batches.
  m.def(
      "vae_elbo_train(Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, "
      "Tensor b_mu, Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, "
      "Tensor w_dec2, Tensor b_dec2, int likelihood=0) -> (Tensor elbo, Tensor recon, Tensor kl, "
      "Tensor saved)");
  m.def(
      "vae_elbo_train_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl, "
      "Tensor x, Tensor eps, Tensor w_enc, Tensor b_enc, Tensor w_mu, Tensor b_mu, "
      "Tensor w_logvar, Tensor b_logvar, Tensor w_dec1, Tensor b_dec1, Tensor w_dec2, "
      "Tensor b_dec2, Tensor saved, bool compute_grad_x, int likelihood=0) -> (Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Self-normalised importance sampling of given log weights [..., N] (and
  // samples [..., N, D]); outputs not asked for are empty (csrc/snis.h).
  m.def(
      "snis(Tensor log_weights, Tensor? samples=None, bool moments=False) -> (Tensor log_norm_weights, "
      "Tensor ess, Tensor log_evidence, Tensor mean, Tensor variance)");
  m.def(
      "snis_backward(Tensor? grad_log_norm_weights, Tensor? grad_ess, Tensor? grad_log_evidence, "
      "Tensor? grad_mean, Tensor? grad_variance, Tensor log_norm_weights, Tensor? samples, Tensor mean, "
      "Tensor variance) -> (Tensor grad_log_weights, Tensor grad_samples)");
  // Resampling: int64 indices [..., M] from log weights [..., N] and given
  // float64 uniforms (csrc/resample.h); not differentiable.
  m.def("resample(Tensor log_weights, Tensor uniforms, int num_samples, str method) -> Tensor");
  // A fixed-grid Runge-Kutta integration of an MLP velocity field (csrc/ode_mlp.h)
  // and its discrete adjoint (csrc/ode_mlp_backward.h).
  m.def(
      "ode_mlp(Tensor x0, Tensor t_grid, Tensor?[] weights, Tensor?[] biases, Tensor time_bias, "
      "Tensor? sample_bias, int method, int activation, float act_param, bool all_states) -> Tensor");
  m.def(
      "ode_mlp_backward(Tensor grad_states, Tensor states, Tensor x0, Tensor t_grid, "
      "Tensor?[] weights, Tensor?[] biases, Tensor time_bias, Tensor? sample_bias, int method, "
      "int activation, float act_param) -> Tensor[]");
  // The ELBO of a VAE with MLPs of 1 to 4 hidden layers and one [mu | logvar]
  // head (csrc/vae_mlp.h), and its backward (gradients in one list:
  // csrc/vae_mlp.h's VaeMlpBackwardCall; grad_x=False leaves x's gradient
  // out, an empty tensor in its place, and skips the product that makes it).
  m.def(
      "vae_mlp_elbo(Tensor x, Tensor eps, Tensor?[] enc_weights, Tensor?[] enc_biases, "
      "Tensor w_head, Tensor b_head, Tensor?[] dec_weights, Tensor?[] dec_biases, "
      "Tensor? dec_logvar, int activation, float act_param, int likelihood) "
      "-> (Tensor elbo, Tensor recon, Tensor kl)");
  m.def(
      "vae_mlp_elbo_backward(Tensor? grad_elbo, Tensor? grad_recon, Tensor? grad_kl, Tensor x, "
      "Tensor eps, Tensor?[] enc_weights, Tensor?[] enc_biases, Tensor w_head, Tensor b_head, "
      "Tensor?[] dec_weights, Tensor?[] dec_biases, Tensor? dec_logvar, int activation, "
      "float act_param, int likelihood, bool grad_x=True) -> Tensor[]");
  // Unnormalised importance log weights log p(x) - log q(x) of B problems,
  // target and proposal diagonal Gaussian mixtures (csrc/importance_log_weights.h),
  // and their backward (gradients of all seven inputs; no upstream gradient: zeros).
  m.def(
      "importance_log_weights(Tensor samples, Tensor mix_weights, Tensor mix_mus, Tensor mix_stds, "
      "Tensor q_weights, Tensor q_mus, Tensor q_stds) -> Tensor");
  m.def(
      "importance_log_weights_backward(Tensor? grad_log_weights, Tensor samples, Tensor mix_weights, "
      "Tensor mix_mus, Tensor mix_stds, Tensor q_weights, Tensor q_mus, Tensor q_stds) -> (Tensor grad_samples, "
      "Tensor grad_mix_weights, Tensor grad_mix_mus, Tensor grad_mix_stds, Tensor grad_q_weights, "
      "Tensor grad_q_mus, Tensor grad_q_stds)");
  // Test hook: the matrix products the kernels run on raw buffers
  // (common/matmul.h; on CUDA float32 the "matmul" path table), a [m, k] @ b [k, n].
  m.def("_matmul(Tensor a, Tensor b) -> Tensor");
  // Test hook (CUDA float32): a hidden layer a @ w^T + bias (+ row_bias) and
  // act of it, the product's epilogue on the same table.
  m.def(
      "_linear_act(Tensor a, Tensor w, Tensor? bias, Tensor? row_bias, int act, float act_param, "
      "bool in_place) -> Tensor[]");
}
