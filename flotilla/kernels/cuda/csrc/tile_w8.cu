#include "tile.cuh"
namespace flotilla::tile {
FLOTILLA_TILE_INSTANTIATE(8)
}
