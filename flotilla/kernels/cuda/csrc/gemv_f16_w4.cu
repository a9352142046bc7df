#include "gemv_instances.cuh"
namespace flotilla::gemv {
FLOTILLA_GEMV_INSTANTIATE(half, 4)
}
