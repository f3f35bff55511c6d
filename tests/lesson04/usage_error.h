// Lesson 04 tests: the one check of a UsageError that every lesson 04 test file uses.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "dtc/errors.h"

namespace dtc::l04 {

// Runs @p f, which must throw UsageError about @p subject whose message contains @p text.
// Any other exception (a TODO(L04) stub's included) propagates and fails the test with its text.
inline void expect_usage(const std::function<void()>& f, const std::string& subject,
                         const std::string& text = "") {
  try {
    f();
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), subject) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
        << "expected the message to contain '" << text << "', got:\n"
        << e.what();
    EXPECT_NE(std::string(e.what()).find("HINT:"), std::string::npos)
        << "the message should say how to fix it:\n"
        << e.what();
    return;
  }
  ADD_FAILURE() << "expected UsageError(" << subject << "), but nothing was thrown";
}

}  // namespace dtc::l04
