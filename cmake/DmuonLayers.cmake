# The library's layers (docs/ARCHITECTURE.md): each folder src/<name>/ is the static library dmuon_<name>,
# declared bottom up in src/CMakeLists.txt with dmuon_layer(). A layer may depend only on layers declared
# before it, so a cycle between folders cannot be written; check_layers.cmake, run by every build, then
# holds each folder's #include lines to the dependencies it declared, and keeps each layer's subfolders
# (src/backend/cuda/, src/backend/cpu/, ...) private to it: another layer includes only the headers at the top of a
# folder it depends on (src/backend/cuda_support.hpp), or the public ones.
#
#   dmuon_layer(<name> [DEPENDS <layers>...] HEADERS <include/dmuon/ headers>...
#               [PRIVATE_LIBS <targets>...] [PUBLIC_LIBS <targets>...] [SKIP <file names>...])
#
# HEADERS names the public headers (include/dmuon/<h>) the layer implements; every public header belongs
# to exactly one layer. SKIP names .cpp files of the folder this build leaves out (one of two
# implementations of an interface, e.g. the communicator with or without MPI). The layer `base`
# (include/dmuon/error.hpp and dtype.hpp, header-only) is below every layer.

set_property(GLOBAL PROPERTY DMUON_LAYERS "")

# dmuon_base: the public include folder and the header-only base every layer uses.
add_library(dmuon_base INTERFACE)
target_include_directories(dmuon_base INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                                $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
set_property(GLOBAL PROPERTY DMUON_LAYERS base)
set_property(GLOBAL PROPERTY DMUON_LAYER_base_DEPS "")
set_property(GLOBAL PROPERTY DMUON_LAYER_base_HEADERS error.hpp dtype.hpp)

function(dmuon_layer name)
  cmake_parse_arguments(L "" "" "DEPENDS;HEADERS;PRIVATE_LIBS;PUBLIC_LIBS;SKIP" ${ARGN})
  get_property(declared GLOBAL PROPERTY DMUON_LAYERS)
  if(name IN_LIST declared)
    message(FATAL_ERROR "dmuon_layer(${name}): declared twice")
  endif()
  foreach(dep IN LISTS L_DEPENDS)
    if(NOT dep IN_LIST declared)
      message(FATAL_ERROR "dmuon_layer(${name}): depends on '${dep}', which is not declared before it "
                          "(declared so far: ${declared}). Layers are declared bottom up, so a dependency "
                          "cycle between folders cannot be written: move the code that needs '${dep}' up, "
                          "or what it needs down.")
    endif()
  endforeach()
  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${name}/*.cpp)
  list(TRANSFORM L_SKIP PREPEND ${PROJECT_SOURCE_DIR}/src/${name}/)
  list(REMOVE_ITEM sources ${L_SKIP})
  if(NOT sources)
    message(FATAL_ERROR "dmuon_layer(${name}): src/${name}/ has no .cpp files")
  endif()
  add_library(dmuon_${name} STATIC ${sources})
  target_include_directories(dmuon_${name} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  list(TRANSFORM L_DEPENDS PREPEND dmuon_ OUTPUT_VARIABLE dep_targets)
  target_link_libraries(dmuon_${name} PUBLIC dmuon_base ${dep_targets} ${L_PUBLIC_LIBS} PRIVATE ${L_PRIVATE_LIBS})
  add_dependencies(dmuon_${name} dmuon_layer_check)
  set_property(GLOBAL APPEND PROPERTY DMUON_LAYERS ${name})
  set_property(GLOBAL PROPERTY DMUON_LAYER_${name}_DEPS "${L_DEPENDS}")
  set_property(GLOBAL PROPERTY DMUON_LAYER_${name}_HEADERS "${L_HEADERS}")
endfunction()

# A folder under src/ that is no layer (no library of dmuon::dmuon) but whose #include lines are checked as a
# layer's: src/capi, the C ABI above the layers it calls. HEADERS: its public headers in include/dmuon/.
#   dmuon_checked_folder(<name> DEPENDS <layers>... [HEADERS <headers>...])
function(dmuon_checked_folder name)
  cmake_parse_arguments(L "" "" "DEPENDS;HEADERS" ${ARGN})
  get_property(declared GLOBAL PROPERTY DMUON_LAYERS)
  foreach(dep IN LISTS L_DEPENDS)
    if(NOT dep IN_LIST declared)
      message(FATAL_ERROR "dmuon_checked_folder(${name}): depends on '${dep}', which is not a layer declared before it")
    endif()
  endforeach()
  set_property(GLOBAL APPEND PROPERTY DMUON_CHECKED_FOLDERS ${name})
  set_property(GLOBAL PROPERTY DMUON_LAYER_${name}_DEPS "${L_DEPENDS}")
  set_property(GLOBAL PROPERTY DMUON_LAYER_${name}_HEADERS "${L_HEADERS}")
endfunction()

# After the last dmuon_layer: writes the layer table for check_layers.cmake and adds the check, which
# runs whenever a source or public header changes and fails the build on an include across the layers.
function(dmuon_layers_done)
  get_property(layers GLOBAL PROPERTY DMUON_LAYERS)
  get_property(folders GLOBAL PROPERTY DMUON_CHECKED_FOLDERS)
  set(table "set(DMUON_LAYERS \"${layers}\")\nset(DMUON_CHECKED_FOLDERS \"${folders}\")\n")
  foreach(layer IN LISTS layers folders)
    get_property(deps GLOBAL PROPERTY DMUON_LAYER_${layer}_DEPS)
    get_property(headers GLOBAL PROPERTY DMUON_LAYER_${layer}_HEADERS)
    string(APPEND table "set(DMUON_LAYER_${layer}_DEPS \"${deps}\")\nset(DMUON_LAYER_${layer}_HEADERS \"${headers}\")\n")
  endforeach()
  set(table_file ${PROJECT_BINARY_DIR}/dmuon_layers.cmake)
  file(CONFIGURE OUTPUT ${table_file} CONTENT "${table}")
  file(GLOB_RECURSE checked CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/*.cpp ${PROJECT_SOURCE_DIR}/src/*.hpp
       ${PROJECT_SOURCE_DIR}/src/*.cu ${PROJECT_SOURCE_DIR}/src/*.cuh ${PROJECT_SOURCE_DIR}/include/dmuon/*.hpp
       ${PROJECT_SOURCE_DIR}/include/dmuon/*.h)
  set(stamp ${PROJECT_BINARY_DIR}/dmuon_layers.checked)
  add_custom_command(OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DTABLE=${table_file} -DSTAMP=${stamp}
            -P ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    DEPENDS ${checked} ${table_file} ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    COMMENT "Checking that every #include stays within its layer's declared dependencies"
    VERBATIM)
  add_custom_target(dmuon_layer_check DEPENDS ${stamp})
endfunction()
