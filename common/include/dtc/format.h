// Small text and number helpers that the course's programs print with (no LibTorch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtc {

/// 834304 -> "834,304".
std::string with_commas(int64_t n);

/// 150 -> "2:30", 3725 -> "1:02:05".
std::string clock_time(double seconds);

/// Bytes in decimal units, as the communication tables print them: 262144 -> "262.1 kB",
/// 1.88e9 -> "1.88 GB", 512 -> "512 B".
std::string human_bytes(double bytes);

/// The median of @p values (0 for none).
double median(std::vector<double> values);

}  // namespace dtc
