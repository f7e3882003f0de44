#include "common/cost_model.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "common/errors.h"

namespace clawcomm {

CostModel CostModel::load(const std::string& path) {
  std::ifstream f(path);
  CLAWCOMM_ARG_CHECK(bool(f), "clawcomm: CLAWCOMM_COST_MODEL=", path, " cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  CostModel m;
  // A flat JSON object of numbers is all a model file holds: find each key
  // and read the number after its colon.
  const struct {
    const char* key;
    double* value;
  } fields[] = {{"shm_alpha", &m.shmAlpha},
                {"shm_beta", &m.shmBeta},
                {"net_alpha", &m.netAlpha},
                {"net_beta", &m.netBeta},
                {"gamma", &m.gamma}};
  for (const auto& field : fields) {
    const std::string quoted = std::string("\"") + field.key + "\"";
    const size_t at = text.find(quoted);
    CLAWCOMM_ARG_CHECK(at != std::string::npos, "clawcomm: the cost model ", path, " has no ",
                       quoted);
    size_t p = text.find(':', at + quoted.size());
    CLAWCOMM_ARG_CHECK(p != std::string::npos, "clawcomm: the cost model ", path, ": ", quoted,
                       " has no value");
    ++p;
    while (p < text.size() && std::isspace(static_cast<unsigned char>(text[p]))) ++p;
    char* end = nullptr;
    const double v = std::strtod(text.c_str() + p, &end);
    CLAWCOMM_ARG_CHECK(end != text.c_str() + p && v >= 0 && v < 1, "clawcomm: the cost model ",
                       path, ": ", quoted, " is not a number of seconds in [0, 1)");
    *field.value = v;
  }
  return m;
}

}  // namespace clawcomm
