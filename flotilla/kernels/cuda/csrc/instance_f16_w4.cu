#include "instances.cuh"
namespace flotilla {
FLOTILLA_INSTANTIATE(half, 4)
}
