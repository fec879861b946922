// The C++ -> Python exception mapping of bindings/errors.cpp, for bindings that raise an error themselves
// (for instance with extra attributes on the exception).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

void register_errors(pybind11::module_& m);

// Sets the Python error (GIL held) for the C++ exception `p`: its colomem.errors class. Other exceptions are
// rethrown for pybind11's own translators, unless `fallback`: then they become ColomemError. Returns true.
bool set_python_error(std::exception_ptr p, bool fallback);
