#include "gemv_instances.cuh"
namespace flotilla::gemv {
FLOTILLA_GEMV_INSTANTIATE(__nv_bfloat16, 8)
}
