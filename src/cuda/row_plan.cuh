// The row machinery shared by the kernels: rows.cuh (a row split across blocks), few_rows.cuh (few rows in
// registers) and launch.cuh (launching a plan).
#pragma once
#include "cuda/launch.cuh"
