// The wheel's library is dvllm/_C.<python suffix>.so, a Python extension module by its name: this makes
// `import dvllm._C` valid (a module with nothing in it). dvllm loads the file with torch.ops.load_library,
// and its ops register themselves (TORCH_LIBRARY) whichever way it is loaded.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
