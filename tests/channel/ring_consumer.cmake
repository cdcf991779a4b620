# Ring consumer tests (host-agent/channel/ring_consumer.h). A fragment,
# included from tests/CMakeLists.txt; sources are named relative to this
# file, so it works whoever includes it.
tmem_add_test(ring_consumer_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/ring_consumer_test.cc
  LIBS tmem_channel
  LABELS unit)
