# mtrain_warnings(<target>): the warning set every first-party target compiles with.
add_library(mtrain_warnings INTERFACE)
target_compile_options(mtrain_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
