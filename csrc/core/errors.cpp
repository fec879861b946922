#include "core/errors.h"

#include <cstdio>

namespace colomem {

void warn(const std::string& msg) { std::fprintf(stderr, "[colomem] warning: %s\n", msg.c_str()); }

}  // namespace colomem
