#include "compress/feedback16.h"

#include <cmath>

#include "common/errors.h"
#include "reduce/ops.h"

namespace clawcomm {
namespace {

template <bool kHalf>
void run(const float* grad, float* residual, uint16_t* payload, size_t n, float scale) {
  const float inverse = 1.0f / scale;
  for (size_t i = 0; i < n; ++i) {
    const auto f = ops::feedback16<kHalf>(grad[i], residual[i], scale, inverse);
    payload[i] = f.payload;
    residual[i] = f.residual;
  }
}

}  // namespace

void encode16WithFeedback(DataType wire, const float* grad, float* residual, uint16_t* payload,
                          size_t n, float scale) {
  CLAWCOMM_ARG_CHECK(wire == DataType::kFloat16 || wire == DataType::kBFloat16,
                     "clawcomm::encode16_feedback: the wire format must be float16 or bfloat16, "
                     "not ",
                     dataTypeName(wire));
  CLAWCOMM_ARG_CHECK(std::isfinite(scale) && scale != 0.0f, "clawcomm::encode16_feedback: scale ",
                     scale, " is not a finite non-zero factor");
  if (wire == DataType::kFloat16) {
    run<true>(grad, residual, payload, n, scale);
  } else {
    run<false>(grad, residual, payload, n, scale);
  }
}

}  // namespace clawcomm
