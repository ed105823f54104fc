// Fast index builders for megacoat's GPT and blended datasets (pybind11, no torch needed).
// megacoat/data/helpers.py holds the numpy reference with identical semantics and the
// description of the arrays; both must return the same values.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

// The blending rule compares floating-point errors; fused multiply-adds would change ties
// relative to the numpy reference, so keep every multiply and subtract separately rounded.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// Row i: (position in document_index, token offset) where sample i starts. Samples are
// seq_length + 1 tokens long and overlap by one token; the last partial sample is dropped.
py::array_t<int64_t> build_sample_index(py::array_t<int32_t, py::array::c_style> sizes,
                                        py::array_t<int32_t, py::array::c_style> document_index,
                                        int64_t seq_length) {
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1");
  auto sz = sizes.unchecked<1>();
  auto di = document_index.unchecked<1>();
  const int64_t num_docs = di.shape(0);
  int64_t total = 0;
  for (int64_t j = 0; j < num_docs; ++j) {
    const int64_t d = di(j);
    if (d < 0 || d >= sz.shape(0)) throw std::out_of_range("document index entry outside sizes");
    total += sz(d);
  }
  const int64_t num_samples = total > 0 ? (total - 1) / seq_length : 0;
  py::array_t<int64_t> out({num_samples + 1, (int64_t)2});
  auto o = out.mutable_unchecked<2>();
  {
    py::gil_scoped_release release;
    o(0, 0) = 0;
    o(0, 1) = 0;
    int64_t doc = 0;         // position in document_index of the current document
    int64_t doc_start = 0;   // token position where that document begins
    for (int64_t i = 1; i <= num_samples; ++i) {
      const int64_t pos = i * seq_length;
      // Advance to the document that holds token `pos` (skips empty documents).
      while (doc_start + sz(di(doc)) <= pos) {
        doc_start += sz(di(doc));
        ++doc;
      }
      o(i, 0) = doc;
      o(i, 1) = pos - doc_start;
    }
  }
  return out;
}

// Sample i comes from the dataset furthest behind its share weights[d] * i (Megatron's greedy rule).
py::tuple build_blending_indices(py::array_t<double, py::array::c_style> weights, int64_t size) {
  auto w = weights.unchecked<1>();
  const int64_t n = w.shape(0);
  if (n < 1) throw std::invalid_argument("need at least one weight");
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  auto di = dataset_index.mutable_unchecked<1>();
  auto dsi = dataset_sample_index.mutable_unchecked<1>();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> counts(n, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double x = i > 1 ? (double)i : 1.0;
      int64_t best = 0;
      double best_err = w(0) * x - (double)counts[0];
      for (int64_t d = 1; d < n; ++d) {
        const double err = w(d) * x - (double)counts[d];
        if (err > best_err) {
          best = d;
          best_err = err;
        }
      }
      di(i) = (int16_t)best;
      dsi(i) = counts[best];
      ++counts[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

PYBIND11_MODULE(_data_helpers, m) {
  m.doc() = "megacoat dataset index builders (C++); see megacoat/data/helpers.py";
  m.def("build_sample_index", &build_sample_index, py::arg("sizes"), py::arg("document_index"),
        py::arg("seq_length"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
