// Host stand-in for NVIDIA's cuda_fp16.h: the emulator's __half (see ../emulate.h).
#include "../emulate.h"
