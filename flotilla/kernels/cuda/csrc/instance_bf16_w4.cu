#include "instances.cuh"
namespace flotilla {
FLOTILLA_INSTANTIATE(__nv_bfloat16, 4)
}
